#include "speculative.h"

#include "error.h"
#include "sampling.h"
#include "scheduler.h"

#include <algorithm>
#include <unordered_map>

namespace dflash {

bool accept_or_resample(const Distribution & p, const Distribution & q, int32_t y, Rng & rng, int32_t * resampled) {
    std::unordered_map<int32_t, float> q_of;
    for (size_t i = 0; i < q.ids.size(); ++i) {
        q_of[q.ids[i]] += q.probs[i];
    }
    float p_y = 0.0f;
    for (size_t i = 0; i < p.ids.size(); ++i) {
        if (p.ids[i] == y) {
            p_y = p.probs[i];
        }
    }
    const float q_y = q_of.count(y) ? q_of[y] : 0.0f;
    if (q_y > 0.0f && rng.uniform() * q_y < p_y) {
        return true;
    }
    // residual distribution max(0, p - q) over p's support (q outside it only removes mass)
    Distribution residual;
    double mass = 0.0;
    for (size_t i = 0; i < p.ids.size(); ++i) {
        const auto it = q_of.find(p.ids[i]);
        const float r = std::max(0.0f, p.probs[i] - (it == q_of.end() ? 0.0f : it->second));
        if (r > 0.0f) {
            residual.ids.push_back(p.ids[i]);
            residual.probs.push_back(r);
            mass += r;
        }
    }
    if (mass <= 0.0) {
        *resampled = draw(p, rng);
        return false;
    }
    for (auto & r : residual.probs) {
        r = float(r / mass);
    }
    *resampled = draw(residual, rng);
    return false;
}

std::vector<std::unique_ptr<dflash_output>> generate_batch(Target & target, Drafter * drafter, DraftSource * source,
                                                           const SpeculativeParams & spec,
                                                           const std::vector<const int32_t *> & prompts,
                                                           const std::vector<int32_t> & n_prompts,
                                                           const dflash_generate_params & params,
                                                           dflash_token_callback callback,
                                                           const std::vector<void *> & user_data) {
    const size_t n_seq = prompts.size();
    if (n_seq == 0 || n_prompts.size() != n_seq || user_data.size() != n_seq) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "need one prompt per sequence");
    }
    if (int32_t(n_seq) > target.info().n_seq_max) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "%zu sequences but the target was created for %d (n_seq_max)", n_seq,
             target.info().n_seq_max);
    }
    if (spec.n_max < 0 || spec.n_min < 0 || spec.n_min > spec.n_max) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "need 0 <= n_min <= n_max (got n_min %d, n_max %d)", spec.n_min, spec.n_max);
    }
    SchedulerParams sp;
    sp.n_max = spec.n_max;
    sp.n_min = spec.n_min;
    sp.p_min = spec.p_min;
    Scheduler sched(target, drafter, sp);
    std::vector<int32_t> ids;
    for (size_t i = 0; i < n_seq; ++i) {
        RequestParams req;
        req.gen = params;
        req.gen.sampling.seed = params.sampling.seed + i;  // sequence i samples with seed + i
        req.slot = int32_t(i);
        req.cache_prompt = false;
        req.draft_source = source;
        if (!prompts[i] || n_prompts[i] <= 0) {
            fail(DFLASH_ERR_INVALID_ARGUMENT, "prompt %zu is empty", i);
        }
        ids.push_back(sched.add(prompts[i], n_prompts[i], std::move(req), callback, user_data[i]));
    }
    dflash_step_info info;
    while (sched.n_pending() > 0) {
        sched.step(&info);
    }
    std::vector<std::unique_ptr<dflash_output>> outs;
    for (int32_t id : ids) {
        outs.push_back(sched.take(id));
    }
    return outs;
}

Draft ReplayDraftSource::draft(int32_t anchor, int32_t pos, int32_t n_max, float temperature, Rng & rng) {
    Draft d;
    // the anchor sits at pos, i.e. continuation index pos - n_prompt; propose what follows it
    const int32_t first = pos - n_prompt_ + 1;
    for (int32_t i = 0; i < n_max; ++i) {
        const int32_t j = first + i;
        if (j < 0 || j >= int32_t(script_.size())) {
            break;
        }
        const int32_t token = (script_[size_t(j)] + offset_) % n_vocab_;
        d.tokens.push_back(token);
        if (temperature > 0.0f) {
            d.q.push_back(Distribution{{token}, {1.0f}});
        }
    }
    return d;
}

}  // namespace dflash
