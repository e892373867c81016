#include "width_policy.h"

#include <algorithm>
#include <cmath>

namespace dflash {

namespace {
constexpr double kPrior = 0.5;          // acceptance before any draft was verified
constexpr double kPriorWeight = 2.0;    // ... worth this many observations
constexpr double kGlobalWeight = 4.0;   // a sequence's own counts start from the global estimate
constexpr double kDecay = 0.998;        // global counts follow the workload (half-life ~350 drafts)
constexpr double kMargin = 1.02;        // speculation must beat plain decoding by 2 % to turn on
constexpr int32_t kInitialProbes = 1;   // a probe right after the first plain step
constexpr int32_t kFirstPeriod = 16, kMaxPeriod = 512;
// With a measured acceptance profile:
constexpr double kProfileWeight = 4.0;  // the profile is worth this many observations (prompts differ)
// c(1 + k) = 1 + kRowSlope * k before any verify was measured: cheaper than every CPU target
// measured (SmolLM2 c(2) ~1.35, the 1.5B's c(8) 2.5-3 with pydflash's kernels), so a probe that
// is priced out under it would not have paid on them either
constexpr double kRowSlope = 0.15;
constexpr double kColdProbeBar = 0.9;   // priced below this, no cold-start probe (only periodic ones)
// The decode steps right after a prefill run slow while caches and buffers warm up (SmolLM2 on
// 2 AVX-512 vCPUs after a 200-token prefill: 7.8, 6.8, 5.8, 5.3, 5.2 ms, steady 5.1). Recorded
// as plain decoding's cost, they priced plain 30 % too high on a cold start, and auto then kept
// drafting where it lost (a held-out prompt at 26 % acceptance: auto 0.76x plain, as n_max 1).
constexpr int32_t kWarmupSteps = 3;
// Realized episodes (observe_step): decay per episode of the same kind (half-life ~23 steps), and the
// episodes of each kind needed before they can overrule the estimates
constexpr double kRealDecay = 0.97;
constexpr int32_t kMinRealSteps = 6;
// Injections of more rows than this before a block are catch-ups after drafting was off
constexpr int32_t kMaxInjectRows = 64;
// A row count's running mean is trusted on its own from this many samples (see target_ms)
constexpr int32_t kTrustedSamples = 4;
// Trim: a confidence bin's acceptance starts at the bin's midpoint (the drafter taken at its word),
// worth this many picks; a position's survival starts at 1 (every draft verified), worth this many
// blocks, so the estimates price a width as before until the trim has been seen to cut it
constexpr double kCalibrationWeight = 4.0;
constexpr double kSurvivalWeight = 2.0;
// A trimmed probe risks little more than its block (the trim verifies only drafts likely to pay),
// so until this many blocks were trimmed the probes come every kTrimProbePeriod steps
constexpr double kTrimLearnBlocks = 8.0;
constexpr double kTrimTrusted = 4.0;  // trimmed blocks before their means price the widths
constexpr int32_t kTrimProbePeriod = 4;

int32_t confidence_bin(float c, int32_t n_bins) {
    if (!(c > 0.0f)) {
        return 0;
    }
    return std::min(n_bins - 1, int32_t(double(c) * n_bins));
}

// running mean that follows recent samples (a busy spell on a shared machine fades out)
void update_mean(double & mean, int32_t & n, double sample) {
    n = std::min(n + 1, 1 << 20);
    const double w = std::max(1.0 / n, 0.1);
    mean = n == 1 ? sample : mean + w * (sample - mean);
}
}  // namespace

void AcceptanceCounts::observe(int32_t n_offered, int32_t n_accepted) {
    const int32_t n = std::min<int32_t>(n_offered, int32_t(offered.size()));
    for (int32_t j = 0; j < n; ++j) {
        offered[size_t(j)] += 1.0;
        if (j < n_accepted) {
            accepted[size_t(j)] += 1.0;
        } else {
            break;  // later positions were not reached
        }
    }
}

void AcceptanceCounts::decay(double factor) {
    for (auto & x : offered) x *= factor;
    for (auto & x : accepted) x *= factor;
}

WidthPolicy::WidthPolicy(int32_t max_width, int32_t max_rows)
    : max_width_(std::max(0, std::min(max_width, 15))), max_rows_(std::max(1, std::min(max_rows, 256))),
      t_rows_(size_t(max_rows_) + 1, 0.0), n_rows_(size_t(max_rows_) + 1, 0),
      t_draft_(size_t(max_width_) + 1, 0.0), n_draft_(size_t(max_width_) + 1, 0), global_(16) {}

void WidthPolicy::set_profile(const std::vector<float> & rates) {
    profile_.clear();
    for (float a : rates) {
        profile_.push_back(std::min(1.0, std::max(0.0, double(a))));
    }
}

void WidthPolicy::observe_prefill() {
    close_episode();
    warmup_left_ = kWarmupSteps;
    pending_rows_ = 0;
}

void WidthPolicy::fix_costs(const std::vector<double> & t_rows_ms, const std::vector<double> & t_draft_ms) {
    constexpr int32_t kFixed = 1 << 20;  // as many samples as never to be outweighed
    for (size_t r = 1; r <= t_rows_ms.size() && r <= size_t(max_rows_); ++r) {
        if (t_rows_ms[r - 1] > 0.0) {
            t_rows_[r] = t_rows_ms[r - 1];
            n_rows_[r] = kFixed;
        }
    }
    for (size_t w = 1; w <= t_draft_ms.size() && w <= size_t(max_width_); ++w) {
        if (t_draft_ms[w - 1] > 0.0) {
            t_draft_[w] = t_draft_ms[w - 1];
            n_draft_[w] = kFixed;
        }
    }
    t_inject_ = 0.0;
    n_inject_ = 0;
    t_rollback_ = 0.0;
    n_rollback_ = 0;
    costs_fixed_ = true;
}

void WidthPolicy::observe_target(int32_t rows, double t_ms) {
    if (costs_fixed_) {
        return;
    }
    if (rows < 1 || rows > max_rows_ || !(t_ms > 0.0)) {
        return;
    }
    if (warmup_left_ > 0) {
        --warmup_left_;
        last_rows_ = rows;
        return;
    }
    // A step whose row count differs from the step before rebuilds the target's graph (llama.cpp
    // reuses it only for the same shape): a probe pays that twice, sustained drafting never. So a
    // multi-row step after a switch is kept back one step and recorded less what the switch back
    // to one row then costs over a plain step; that switched plain step is no plain sample.
    const bool switched = last_rows_ != 0 && rows != last_rows_;
    last_rows_ = rows;
    if (pending_rows_ > 0) {
        const bool back = switched && rows == 1 && n_rows_[1] > 0;
        const double t_switch = back ? std::max(0.0, t_ms - t_rows_[1]) : 0.0;
        // Trimmed blocks vary the row count from step to step: there the switch back is part of
        // what a multi-row step costs (SmolLM2, 2 AVX2 cores: 1, 2, 1, 2 rows take 8.9 and 10.8 ms
        // where 1 and 2 rows alone take 8.1 and 9.6 ms)
        const double t_pending = trimming_ ? pending_ms_ + t_switch
                                           : std::max(pending_ms_ - t_switch, n_rows_[1] > 0 ? t_rows_[1] : 0.0);
        update_mean(t_rows_[size_t(pending_rows_)], n_rows_[size_t(pending_rows_)], t_pending);
        pending_rows_ = 0;
        if (back) {
            return;
        }
    }
    if (switched && rows > 1) {
        pending_rows_ = rows;
        pending_ms_ = t_ms;
        return;
    }
    update_mean(t_rows_[size_t(rows)], n_rows_[size_t(rows)], t_ms);
}

void WidthPolicy::observe_draft(int32_t width, double t_ms) {
    if (!costs_fixed_ && width >= 1 && width <= max_width_ && t_ms > 0.0) {
        update_mean(t_draft_[size_t(width)], n_draft_[size_t(width)], t_ms);
    }
}

void WidthPolicy::observe_inject(int32_t n_rows, double t_ms) {
    // a catch-up after drafting was off (a probe) is not what a block pays while drafting is on
    if (!costs_fixed_ && n_rows >= 0 && n_rows <= kMaxInjectRows && t_ms >= 0.0) {
        update_mean(t_inject_, n_inject_, t_ms);
    }
}

void WidthPolicy::observe_rollback(double t_ms) {
    if (!costs_fixed_ && t_ms >= 0.0) {
        update_mean(t_rollback_, n_rollback_, t_ms);
    }
}

void WidthPolicy::observe_step(StepKind kind, int32_t n_committed, double t_ms) {
    if (costs_fixed_ || n_committed <= 0 || !(t_ms > 0.0)) {  // fixed costs: no measured episodes either
        close_episode();
        return;
    }
    if (kind == StepKind::kHistory) {
        if (episode_ >= 0) {
            episode_tokens_ += double(n_committed);
            episode_ms_ += t_ms;
            close_episode();
        }
        return;
    }
    close_episode();
    episode_ = kind == StepKind::kDrafted ? 1 : 0;
    episode_tokens_ = double(n_committed);
    episode_ms_ = t_ms;
}

void WidthPolicy::close_episode() {
    if (episode_ >= 0) {
        real_tokens_[episode_] = kRealDecay * real_tokens_[episode_] + episode_tokens_;
        real_ms_[episode_] = kRealDecay * real_ms_[episode_] + episode_ms_;
        real_n_[episode_] = std::min(real_n_[episode_] + 1, 1 << 20);
    }
    episode_ = -1;
}

bool WidthPolicy::realized_loses() const {
    if (real_n_[0] < kMinRealSteps || real_n_[1] < kMinRealSteps) {
        return false;
    }
    return real_tokens_[1] / real_ms_[1] < real_tokens_[0] / real_ms_[0];
}

void WidthPolicy::observe_accept(int32_t n_offered, int32_t n_accepted) {
    if (n_offered <= 0) {
        return;
    }
    global_.decay(kDecay);
    global_.observe(n_offered, n_accepted);
}

double WidthPolicy::calibrated(float confidence) const {
    const int32_t b = confidence_bin(confidence, kConfBins);
    const double mid = (double(b) + 0.5) / kConfBins;
    return (cal_accepted_[b] + mid * kCalibrationWeight) / (cal_offered_[b] + kCalibrationWeight);
}

// S_j = prod_{i<=j} c_i, c_i: the chance the trim keeps draft i of a block that kept draft i - 1.
// A position the trim has not been seen at (a width never chosen) takes the previous position's c.
double WidthPolicy::survival(int32_t j) const {
    double s = 1.0, c = 1.0;
    for (int32_t i = 0; i <= std::min(j, 15); ++i) {
        c = (surv_kept_[i] + c * kSurvivalWeight) / (surv_drafted_[i] + kSurvivalWeight);
        s *= c;
    }
    return s;
}

int32_t WidthPolicy::trim(const std::vector<float> & confidence, int32_t k, int32_t rows, int32_t n_seqs) const {
    if (k <= 0 || int32_t(confidence.size()) < k || rows < 1 || n_seqs < 1) {
        return std::max(k, 0);  // nothing to cut, or no confidence to cut by
    }
    const double t_base = priced_target_ms(rows), t_plain = target_ms(n_seqs);
    if (!(t_base > 0.0) || !(t_plain > 0.0)) {
        return k;  // costs not measured yet: verify what the width asked for
    }
    // the tokens a row's time yields when plain decoding: what verifying one more draft must beat
    const double rate = double(n_seqs) / t_plain;
    double run = 1.0, expected = 0.0, best_value = 0.0;
    int32_t best = 0;
    for (int32_t j = 0; j < k; ++j) {
        run *= calibrated(confidence[size_t(j)]);
        expected += run;  // tokens the first j + 1 drafts are expected to add
        const double t = priced_target_ms(rows + j + 1);
        if (!(t > 0.0)) {
            break;
        }
        const double value = expected - rate * (t - t_base);
        if (value > best_value) {
            best_value = value;
            best = j + 1;
        }
    }
    return best;
}

bool WidthPolicy::trimmed_block(int32_t width, double * kept, double * accepted) const {
    double total = 0.0;
    for (double b : trim_blocks_) {
        total += b;
    }
    if (total < kTrimTrusted || width < 1) {
        return false;
    }
    // the width itself, else the nearest measured one, wider first (a wider block's trim can
    // only keep more: an optimistic guess that the narrower width then measures)
    for (int32_t d = 0; d < 16; ++d) {
        for (int32_t w : {width + d, width - d}) {
            if (w >= 1 && w < 16 && trim_blocks_[w] >= 1.0) {
                *kept = std::min(double(width), trim_block_kept_[w] / trim_blocks_[w]);
                *accepted = std::min(*kept, trim_block_accepted_[w] / trim_blocks_[w]);
                return true;
            }
        }
    }
    return false;
}

void WidthPolicy::observe_trim(const std::vector<float> & confidence, int32_t drafted, int32_t kept,
                               int32_t accepted) {
    if (drafted <= 0) {
        return;
    }
    if (!confidence.empty() && drafted < 16) {
        for (int32_t w = 0; w < 16; ++w) {
            trim_blocks_[w] *= kDecay;
            trim_block_kept_[w] *= kDecay;
            trim_block_accepted_[w] *= kDecay;
        }
        trim_blocks_[drafted] += 1.0;
        trim_block_kept_[drafted] += double(kept);
        trim_block_accepted_[drafted] += double(std::min(accepted, kept));  // what it really added, not what the trim expected
    }
    for (int32_t j = 0; j < 16; ++j) {
        surv_drafted_[j] *= kDecay;
        surv_kept_[j] *= kDecay;
    }
    for (int32_t j = 0; j < std::min(drafted, std::min(kept + 1, 16)); ++j) {  // drafted j, kept j - 1
        surv_drafted_[j] += 1.0;
        surv_kept_[j] += j < kept ? 1.0 : 0.0;
    }
    for (int32_t b = 0; b < kConfBins; ++b) {
        cal_offered_[b] *= kDecay;
        cal_accepted_[b] *= kDecay;
    }
    // the picks verification judged: the kept ones up to the first rejection
    for (int32_t j = 0; j < std::min(kept, int32_t(confidence.size())); ++j) {
        const int32_t b = confidence_bin(confidence[size_t(j)], kConfBins);
        cal_offered_[b] += 1.0;
        if (j >= accepted) {
            break;
        }
        cal_accepted_[b] += 1.0;
    }
}

void WidthPolicy::probe_done() {
    steps_since_probe_ = 0;
    n_probes_++;
}

double WidthPolicy::target_ms(int32_t rows) const {
    if (rows < 1) {
        return 0.0;
    }
    rows = std::min(rows, max_rows_);
    const double measured = n_rows_[size_t(rows)] > 0 ? t_rows_[size_t(rows)] : -1.0;
    if (n_rows_[size_t(rows)] >= kTrustedSamples) {
        return measured;
    }
    // A row count sampled only a few times is bounded by the well-sampled ones around it: one slow
    // first sample (a graph rebuild after a shape switch, a busy spell) priced it out, and a width
    // never chosen again is never measured again (SmolLM2 on AVX2 under auto: 5 rows sampled twice
    // at 21.6 ms where 4 took 14.2 and 5 take ~15.5 in steady steps). The tuning cache carries such
    // samples into the next process (one held 4 rows at 1,185 ms: history drafts never ran again).
    double bound = modelled_ms(rows, kTrustedSamples);
    if (bound <= 0.0 && rows > 1 && n_rows_[1] >= kTrustedSamples) {  // only one row trusted: the cheap model
        bound = t_rows_[1] * (1.0 + kRowSlope * double(rows - 1));
    }
    if (measured > 0.0) {
        return bound > 0.0 ? std::min(measured, bound) : measured;
    }
    const double any = modelled_ms(rows, 1);
    return bound > 0.0 && any > 0.0 ? std::min(any, bound) : any;
}

// Target time of `rows` rows from the row counts sampled at least min_samples times (not rows
// itself): between two of them, interpolated; past the largest, its measured slope; below the
// smallest, no more than it; negative when they do not determine it.
double WidthPolicy::modelled_ms(int32_t rows, int32_t min_samples) const {
    auto known = [&](int32_t r) { return r != rows && n_rows_[size_t(r)] >= min_samples; };
    int32_t lo = -1, lo2 = -1, hi = -1;
    for (int32_t r = rows - 1; r >= 1; --r) {
        if (known(r)) {
            if (lo < 0) {
                lo = r;
            } else {
                lo2 = r;
                break;
            }
        }
    }
    for (int32_t r = rows + 1; r <= max_rows_; ++r) {
        if (known(r)) {
            hi = r;
            break;
        }
    }
    if (lo > 0 && hi > 0) {  // between two measured row counts
        const double f = double(rows - lo) / double(hi - lo);
        return t_rows_[size_t(lo)] + f * (t_rows_[size_t(hi)] - t_rows_[size_t(lo)]);
    }
    if (lo > 0 && lo2 > 0) {  // past the largest: the measured slope (more rows never cost less)
        const double slope = std::max(0.0, (t_rows_[size_t(lo)] - t_rows_[size_t(lo2)]) / double(lo - lo2));
        return t_rows_[size_t(lo)] + slope * double(rows - lo);
    }
    if (hi > 0 && lo < 0) {  // below the smallest measured: no more than it
        return t_rows_[size_t(hi)];
    }
    return -1.0;  // one point or none: unknown
}

double WidthPolicy::draft_ms(int32_t width) const {
    if (width < 1 || width > max_width_) {
        return 0.0;
    }
    if (n_draft_[size_t(width)] > 0) {
        return t_draft_[size_t(width)];
    }
    // the nearest measured width (a block's cost changes little with its length)
    for (int32_t d = 1; d <= max_width_; ++d) {
        for (int32_t w : {width - d, width + d}) {
            if (w >= 1 && w <= max_width_ && n_draft_[size_t(w)] > 0) {
                return t_draft_[size_t(w)];
            }
        }
    }
    return -1.0;
}

double WidthPolicy::priced_target_ms(int32_t rows) const {
    const double t = target_ms(rows);
    if (t > 0.0 || n_rows_[1] == 0) {
        return t;
    }
    int32_t lo = std::min(rows, max_rows_);  // the largest measured row count below
    while (lo >= 1 && n_rows_[size_t(lo)] == 0) {
        --lo;
    }
    return lo < 1 ? -1.0 : t_rows_[size_t(lo)] + kRowSlope * t_rows_[1] * double(rows - lo);
}

double WidthPolicy::row_cost(int32_t rows) const {
    const double t1 = target_ms(1);
    if (n_rows_[1] == 0 || !(t1 > 0.0)) {
        return -1.0;
    }
    if (rows <= 1) {
        return 1.0;
    }
    if (rows > max_rows_) {
        return -1.0;
    }
    const double t = priced_target_ms(rows);
    return t > 0.0 ? std::max(1.0, t / t1) : -1.0;
}

std::vector<double> WidthPolicy::alphas(const AcceptanceCounts * own) const {
    std::vector<double> a(size_t(max_width_) + 1, kPrior);
    double last = kPrior;
    for (int32_t j = 0; j < max_width_; ++j) {
        const double off = global_.offered[size_t(j)], acc = global_.accepted[size_t(j)];
        if (!profile_.empty()) {  // the measured rate of the position (past the profile: its last)
            const double prior = profile_[std::min(size_t(j), profile_.size() - 1)];
            last = (acc + prior * kProfileWeight) / (off + kProfileWeight);
        } else if (off > 0.0) {
            last = (acc + kPrior * kPriorWeight) / (off + kPriorWeight);
        }
        double aj = last;  // a position never offered takes the last estimate
        if (own && own->offered[size_t(j)] > 0.0) {
            aj = (own->accepted[size_t(j)] + aj * kGlobalWeight) / (own->offered[size_t(j)] + kGlobalWeight);
        }
        a[size_t(j)] = aj;
    }
    return a;
}

double WidthPolicy::fractional_ms(double rows, bool priced) const {
    const int32_t lo = std::max(1, int32_t(std::floor(rows)));
    const double t_lo = priced ? priced_target_ms(lo) : target_ms(lo);
    const double f = rows - double(lo);
    if (f <= 1e-9 || t_lo <= 0.0) {
        return t_lo;
    }
    const double t_hi = priced ? priced_target_ms(lo + 1) : target_ms(lo + 1);
    return t_hi > 0.0 ? t_lo + f * (t_hi - t_lo) : -1.0;
}

double WidthPolicy::throughput(const std::vector<Candidate> & seqs, const std::vector<std::vector<double>> & alphas,
                               int32_t width, bool priced) const {
    int32_t n_drafting = 0;
    double rows = 0.0, tokens = 0.0;
    for (size_t i = 0; i < seqs.size(); ++i) {
        const int32_t k = std::min(width, seqs[i].cap);
        n_drafting += k > 0 ? 1 : 0;
        rows += 1.0;
        tokens += 1.0;
        double kept = 0.0, accepted = 0.0;
        if (k > 0 && seqs[i].trimmed && trimmed_block(k, &kept, &accepted)) {
            rows += kept;  // what trimmed blocks of this width verified, and of that accepted
            tokens += accepted;
            continue;
        }
        // draft j is verified at the rate the trim kept it (S_j), and then passes at prod a
        double run = 1.0;
        for (int32_t j = 0; j < k; ++j) {
            run *= alphas[i][size_t(j)];
            rows += survival(j);
            tokens += survival(j) * run;
        }
    }
    const double t_target = fractional_ms(rows, priced);
    const double t_block = width == 0 ? 0.0 : draft_ms(width);
    const double t_draft = t_block < 0.0 ? t_block : t_block + (width == 0 ? 0.0 : inject_ms() + rollback_ms());
    if (t_target <= 0.0 || t_draft < 0.0) {
        return -1.0;  // unknown
    }
    return tokens / (t_target + double(n_drafting) * t_draft);
}

int32_t WidthPolicy::choose(const std::vector<Candidate> & seqs, bool * probe) {
    *probe = false;
    n_steps_++;
    steps_since_probe_++;
    int32_t cap = 0;
    for (const auto & c : seqs) {
        cap = std::max(cap, c.cap);
    }
    cap = std::min(cap, max_width_);
    if (cap <= 0 || seqs.empty()) {
        return 0;
    }
    trimming_ = false;
    for (const auto & c : seqs) {
        trimming_ = trimming_ || c.trimmed;
    }
    std::vector<std::vector<double>> alphas_of;  // once per step, not per width
    for (const auto & c : seqs) {
        alphas_of.push_back(alphas(c.counts));
    }
    const double plain = throughput(seqs, alphas_of, 0);
    if (plain <= 0.0) {
        return 0;  // plain decoding's cost is measured first
    }
    int32_t best = 0, best_probe = 0;
    double best_s = plain, best_probe_s = -1.0;
    for (int32_t w = 1; w <= cap; ++w) {
        const double s = throughput(seqs, alphas_of, w);
        if (s > best_probe_s) {
            best_probe_s = s;
            best_probe = w;
        }
        if (s > best_s * (best == 0 ? kMargin : 1.0)) {
            best_s = s;
            best = w;
        }
    }
    if (best > 0 && realized_loses()) {
        best = 0;  // priced as paying, measured slower than plain steps: probed now and then as "off"
    }
    if (best > 0) {
        probe_period_ = kFirstPeriod;
        last_width_ = best;
        return best;
    }
    // speculation does not pay by the estimates: probe now and then, the more rarely the further
    // the best width is from paying (a probe costs about what it misses)
    bool priced = false;
    if (best_probe_s <= 0.0 && !profile_.empty()) {  // nothing verified yet: price it with the profile
        for (int32_t w = 1; w <= cap; ++w) {
            const double s = throughput(seqs, alphas_of, w, true);
            if (s > best_probe_s) {
                best_probe_s = s;
                best_probe = w;
                priced = true;
            }
        }
    }
    const double ratio = best_probe_s > 0.0 ? best_probe_s / plain : 1.0;
    base_period_ = ratio < 0.6 ? 128 : ratio < 0.85 ? 64 : kFirstPeriod;
    last_width_ = 0;
    // (not for a drafter the estimates put far from paying: known to lose, it is not worth learning)
    const bool learning = trimming_ && surv_drafted_[0] < kTrimLearnBlocks && ratio >= kColdProbeBar;
    bool initial = n_probes_ < kInitialProbes && steps_since_probe_ >= 2;
    if (initial && priced && ratio < kColdProbeBar && !learning) {
        n_probes_ = kInitialProbes;  // priced out: no cold-start probe, only the periodic ones
        initial = false;
    }
    const int32_t period = learning ? kTrimProbePeriod : std::max(probe_period_, base_period_);
    if (initial || steps_since_probe_ >= period) {
        if (!initial && !learning) {
            probe_period_ = std::min(period * 2, kMaxPeriod);
        }
        *probe = true;
        last_width_ = best_probe_s > 0.0 ? best_probe : 1;  // unknown costs: the cheapest probe
        return last_width_;
    }
    return 0;
}

void WidthPolicy::save(dflash_tuning * out) const {
    *out = dflash_tuning{};
    for (int32_t r = 1; r <= max_rows_ && r <= 256; ++r) {
        out->t_rows_ms[r - 1] = n_rows_[size_t(r)] > 0 ? float(t_rows_[size_t(r)]) : 0.0f;
    }
    for (int32_t w = 1; w <= max_width_; ++w) {
        out->t_draft_ms[w - 1] = n_draft_[size_t(w)] > 0 ? float(t_draft_[size_t(w)]) : 0.0f;
    }
    for (size_t j = 0; j < 16; ++j) {
        out->offered[j] = float(global_.offered[j]);
        out->accepted[j] = float(global_.accepted[j]);
        out->trim_drafted[j] = float(surv_drafted_[j]);
        out->trim_kept[j] = float(surv_kept_[j]);
    }
    for (int32_t b = 0; b < kConfBins; ++b) {
        out->trim_offered[b] = float(cal_offered_[b]);
        out->trim_accepted[b] = float(cal_accepted_[b]);
    }
    for (size_t w = 0; w < 16; ++w) {
        out->trim_blocks[w] = float(trim_blocks_[w]);
        out->trim_block_kept[w] = float(trim_block_kept_[w]);
        out->trim_block_accepted[w] = float(trim_block_accepted_[w]);
    }
}

void WidthPolicy::load(const dflash_tuning & in) {
    for (int32_t r = 1; r <= max_rows_ && r <= 256; ++r) {
        const float t = in.t_rows_ms[r - 1];
        if (std::isfinite(t) && t > 0.0f) {
            t_rows_[size_t(r)] = t;
            n_rows_[size_t(r)] = 1;
        }
    }
    for (int32_t w = 1; w <= max_width_; ++w) {
        const float t = in.t_draft_ms[w - 1];
        if (std::isfinite(t) && t > 0.0f) {
            t_draft_[size_t(w)] = t;
            n_draft_[size_t(w)] = 1;
        }
    }
    for (size_t j = 0; j < 16; ++j) {
        const float off = in.offered[j], acc = in.accepted[j];
        if (std::isfinite(off) && std::isfinite(acc) && off >= 0.0f && acc >= 0.0f && acc <= off) {
            global_.offered[j] = off;
            global_.accepted[j] = acc;
        }
    }
    auto counts = [](float n, float of) { return std::isfinite(n) && std::isfinite(of) && n >= 0.0f && n <= of; };
    for (size_t j = 0; j < 16; ++j) {
        if (counts(in.trim_kept[j], in.trim_drafted[j])) {
            surv_drafted_[j] = in.trim_drafted[j];
            surv_kept_[j] = in.trim_kept[j];
        }
    }
    for (int32_t b = 0; b < kConfBins; ++b) {
        if (counts(in.trim_accepted[b], in.trim_offered[b])) {
            cal_offered_[b] = in.trim_offered[b];
            cal_accepted_[b] = in.trim_accepted[b];
        }
    }
    for (size_t w = 1; w < 16; ++w) {
        const float b = in.trim_blocks[w], r = in.trim_block_kept[w], g = in.trim_block_accepted[w];
        if (counts(0.0f, b) && counts(r, float(w) * b) && counts(g, r)) {
            trim_blocks_[w] = b;
            trim_block_kept_[w] = r;
            trim_block_accepted_[w] = g;
        }
    }
    if (global_.n_observed() > 0.0 || surv_drafted_[0] > 0.0) {
        n_probes_ = kInitialProbes;  // learned before (drafts verified or blocks trimmed): no cold-start probes
    }
}

}  // namespace dflash
