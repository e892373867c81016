// How many drafts each sequence verifies in the next step (the draft width), chosen inside the
// scheduler's loop from what the loop itself measures.
//
// A step that verifies width w for n sequences decodes R = sum_s (1 + k_s) target rows,
// k_s = min(w, cap_s), and drafts n blocks. With a_{s,j} the probability that sequence s's j-th
// draft is accepted given the earlier ones were,
//
//     expected tokens     E(w) = sum_s (1 + sum_{i<=k_s} prod_{j<=i} a_{s,j})
//     expected time       C(w) = T(R) + n * (D(w) + I + B) (T: target batch, D: one drafter block,
//                                                          I: the injection of what was committed
//                                                          since the sequence's last block,
//                                                          B: what rolling a block back costs beyond
//                                                          the verify: a recurrent target's
//                                                          checkpoint, restore and replay)
//     throughput          E(w) / C(w),          w = 0: n / T(n), the drafter is not run at all
//
// T(R) is learned per row count from every step (running mean of recent steps, interpolated
// between measured row counts, extrapolated with the measured slope; a row count with only a few
// samples no dearer than the well-sampled ones make it), D(w) per width, a_j from
// every verified draft (decaying counts; per sequence on top of the global estimate). While no
// width beats plain decoding, a probe step (the best w >= 1) runs now and then, at first after the
// first plain steps, then at a period that doubles each time a probe confirms "off".
//
// Under auto, a greedy drafted block is then cut to the prefix worth verifying (trim): the
// drafter's own confidence in each pick, calibrated online against what verification accepted,
// gives the chance q_j that drafts 1..j all pass; draft j is verified when that chance pays for its
// row at plain decoding's rate (k maximizing sum_{j<=k} q_j - (T(R + k) - T(R)) * n / T(n)). For
// such sequences the estimates above take, per width, the trimmed blocks' mean kept and mean
// accepted drafts in place of k_s and E_s - 1 once 4 blocks were trimmed; before
// that, draft j counts as verified at the rate the trim kept it (S_j), a_j as measured on the
// drafts that were verified:
//
//     E(w) = sum_s (1 + sum_{i<=k_s} S_i prod_{j<=i} a_{s,j}),   rows: sum_s (1 + sum_{i<=k_s} S_i)
//
// A drafter file may carry a measured acceptance profile (per-position rates on held-out prompts,
// `pydflash drafter-profile`). It replaces the blind prior, and with the drafter's block time
// measured once at load (seed_draft) and a cheap-verification model of the target's c(k) from its
// measured one-row time, it prices the cold-start probe: a drafter that would not pay even at those
// prices is not probed at once, only at the period its distance from paying sets.
#pragma once

#include "dflash.h"

#include <cstdint>
#include <vector>

namespace dflash {

// Acceptance counts by draft position j (offered: drafts at j verified, accepted: of those).
struct AcceptanceCounts {
    std::vector<double> offered, accepted;
    explicit AcceptanceCounts(int32_t n = 16) : offered(size_t(n), 0.0), accepted(size_t(n), 0.0) {}
    void observe(int32_t n_offered, int32_t n_accepted);  // one verified draft of n_offered tokens
    void decay(double factor);
    double n_observed() const { return offered.empty() ? 0.0 : offered[0]; }
};

class WidthPolicy {
public:
    // max_width: the drafter's block_size - 1; max_rows: the target's batch size
    WidthPolicy(int32_t max_width, int32_t max_rows);

    struct Candidate {
        int32_t cap;                      // most drafts this sequence may verify now
        const AcceptanceCounts * counts;  // the sequence's own counts
        bool trimmed = false;             // its blocks are trimmed (greedy, the drafter's confidence known)
    };
    // The width of the next step, and whether it is a probe.
    int32_t choose(const std::vector<Candidate> & seqs, bool * probe);

    // The drafter's measured acceptance profile (rates[j]: draft j accepted given the earlier ones
    // were): the prior of every position in place of kPrior, worth kProfileWeight observations.
    void set_profile(const std::vector<float> & rates);
    bool has_profile() const { return !profile_.empty(); }
    // One drafter block of `width` drafts measured outside the loop (at load), as observe_draft.
    void seed_draft(int32_t width, double t_ms) { observe_draft(width, t_ms); }

    // One decode step of `rows` target rows that took t_target_ms (no prefill rows in it).
    void observe_target(int32_t rows, double t_target_ms);
    // A step with prefill rows ran: the next decode steps are warming up (not recorded).
    void observe_prefill();
    // How many of a greedy block's k drafts to verify (0..k), from the drafter's confidence in each
    // pick; `rows` target rows are in the step already (this sequence's own first row included).
    int32_t trim(const std::vector<float> & confidence, int32_t k, int32_t rows, int32_t n_seqs) const;
    // A block of `drafted` drafts (its width) of which the first `kept` were verified, `accepted`
    // of those accepted; confidence: the drafter's per pick (calibration), empty for blocks that
    // were not trimmed (survival only).
    void observe_trim(const std::vector<float> & confidence, int32_t drafted, int32_t kept, int32_t accepted);
    // Calibrated chance that a pick the drafter gave this confidence is accepted (its earlier ones were).
    double calibrated(float confidence) const;

    // One drafter block of width w (w + 1 slots), for one sequence, without its injection.
    void observe_draft(int32_t width, double t_ms);
    // The injection before one block: the features of the n_rows rows the sequence committed since
    // its last block (lookup and plain steps too), which every block pays on top of its own cost.
    void observe_inject(int32_t n_rows, double t_ms);
    // What one drafting sequence's rollback cost in a step beyond its verify (checkpoint rollback:
    // the state saved, restored after a rejection, the accepted rows decoded again).
    void observe_rollback(double t_ms);
    // One verified draft: n_offered drafts, the first n_accepted accepted.
    void observe_accept(int32_t n_offered, int32_t n_accepted);
    // One decode step under auto without prefill rows, as it really ran: its committed tokens and
    // whole time (injection, drafting, verification, acceptance). A plain or drafted step and the
    // step after it when that one verified drafts from the history make one episode: drafts from
    // the drafter where the history has no match often only take the first tokens of a repeat that
    // the history would have drafted next. Drafting that the estimates price as paying but whose
    // episodes run slower than plain ones (this overlap, a block's catch-up injections, shape
    // switches: what the model leaves out) is turned off like a width that does not pay.
    enum class StepKind { kPlain, kDrafted, kHistory };
    void observe_step(StepKind kind, int32_t n_committed, double t_ms);
    // Fixed costs in place of measured ones (tests, reproducible runs): t_rows_ms[r - 1] a target
    // step of r rows, t_draft_ms[w - 1] a drafter block of width w; from then on no timing is
    // learned (acceptance still is), so every decision is the same on a busy machine.
    void fix_costs(const std::vector<double> & t_rows_ms, const std::vector<double> & t_draft_ms);
    // A probe step finished: keep probing rarely if speculation still does not pay.
    void probe_done();

    // Target time of `rows` rows over one row's: measured (interpolated), else priced by the
    // cheap-verification model; negative until one-row steps were measured.
    double row_cost(int32_t rows) const;

    // Estimates (ms); negative when nothing is known yet.
    double target_ms(int32_t rows) const;
    double draft_ms(int32_t width) const;   // the block alone
    double inject_ms() const { return n_inject_ > 0 ? t_inject_ : 0.0; }  // per block, mean
    double rollback_ms() const { return n_rollback_ > 0 ? t_rollback_ : 0.0; }  // per drafted block, mean
    std::vector<double> alphas(const AcceptanceCounts * own) const;

    // What the policy has learned, to remember across processes.
    void save(dflash_tuning * out) const;
    void load(const dflash_tuning & in);

    int32_t max_width() const { return max_width_; }

private:
    // priced: row counts never measured are priced by the cheap-verification model (profile only)
    double throughput(const std::vector<Candidate> & seqs, const std::vector<std::vector<double>> & alphas,
                      int32_t width, bool priced = false) const;
    double priced_target_ms(int32_t rows) const;
    double modelled_ms(int32_t rows, int32_t min_samples) const;
    double fractional_ms(double rows, bool priced) const;  // target_ms between whole row counts
    double survival(int32_t j) const;                      // S_j: draft j of a block kept by the trim
    // a trimmed block of width w: mean kept and accepted drafts (the nearest measured width;
    // false before kTrimTrusted blocks were trimmed)
    bool trimmed_block(int32_t width, double * kept, double * accepted) const;
    bool realized_loses() const;
    void close_episode();

    int32_t max_width_, max_rows_;
    std::vector<double> t_rows_;   // running mean ms per row count (index = rows; 0 = unknown)
    std::vector<int32_t> n_rows_;  // samples behind each mean
    std::vector<double> t_draft_;  // per width (index = width)
    std::vector<int32_t> n_draft_;
    double real_tokens_[2] = {0.0, 0.0}, real_ms_[2] = {0.0, 0.0};  // decayed sums: [0] plain, [1] drafted
    int32_t real_n_[2] = {0, 0};
    int32_t episode_ = -1;           // the open episode's kind (-1: none), its tokens and time
    double episode_tokens_ = 0.0, episode_ms_ = 0.0;
    // trim: acceptance by confidence bin (decaying counts) and, per position j, blocks that drafted
    // j having kept j - 1, and of those the ones that kept j
    static constexpr int32_t kConfBins = 10;
    double cal_offered_[kConfBins] = {}, cal_accepted_[kConfBins] = {};
    double surv_drafted_[16] = {}, surv_kept_[16] = {};
    double trim_blocks_[16] = {}, trim_block_kept_[16] = {}, trim_block_accepted_[16] = {};  // per width: decayed sums
    bool trimming_ = false;        // the last choose() had sequences whose blocks are trimmed
    double t_inject_ = 0.0;        // running mean ms of the injection before a block
    int32_t n_inject_ = 0;
    bool costs_fixed_ = false;
    double t_rollback_ = 0.0;      // running mean ms of a drafted block's rollback beyond its verify
    int32_t n_rollback_ = 0;
    AcceptanceCounts global_;
    std::vector<double> profile_;  // measured acceptance by position (empty: the blind prior)
    int32_t steps_since_probe_ = 0;
    int32_t probe_period_ = 16;   // grows while probes keep confirming "off"
    int32_t base_period_ = 16;    // from how far the best width is from paying
    int32_t last_width_ = 0;
    int32_t last_rows_ = 0;        // rows of the last observed step
    int32_t pending_rows_ = 0;     // a multi-row step after a shape switch, recorded one step later
    double  pending_ms_ = 0.0;
    int32_t n_probes_ = 0;
    int32_t warmup_left_ = 0;      // decode steps after a prefill still to leave unrecorded
    int32_t n_steps_ = 0;
};

}  // namespace dflash
