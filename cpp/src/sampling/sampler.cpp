// Token sampler: turns one row of logits into one token id.
//
// What it owns: a copy of the SamplingParams and a 64-bit RNG state. Nothing else persists
// between calls; the caller passes the recent tokens for the repetition penalty. It never touches
// the caller's logits (it works on its own scratch copy) and never allocates per-vocab state that
// outlives a call, apart from per-thread scratch buffers (see Scratch) that are reused so that a
// 150k-entry vocabulary does not cost fresh page-faulting allocations on every token. Not
// thread-safe: one caller per Sampler (the RNG state advances per draw).
//
// Pipeline (llama.cpp's default order, so the same settings mean the same thing there and here):
//   repetition penalty -> [temperature 0: argmax] -> top-k -> softmax -> top-p -> min-p
//   -> temperature -> draw
// top-p and min-p are judged on the temperature-1 distribution (after top-k), temperature only
// reshapes the survivors. Every filter keeps at least the most likely token. (min-p actually runs
// before top-p below, which gives the same set faster; see the comment there.)
//
// Determinism: the RNG is splitmix64 (64-bit state, the one word Sampler keeps), a draw uses the
// top 53 bits of one output, and probabilities are accumulated in double in an order that depends
// on nothing but the logits (descending logit with ties by ascending id wherever a filter sorted,
// plain id order otherwise), so one seed gives one token sequence on any platform.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <unordered_set>
#include <vector>

#include "sharpi/session.h"

namespace sharpi {
namespace {

uint64_t splitmix64_next(uint64_t& state) {
    state += 0x9E3779B97F4A7C15ull;
    uint64_t z = state;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

std::string fmt_float(float v) {
    // std::to_string prints "nan" / "inf" too, which is what we want in messages.
    return std::to_string(v);
}

void validate(const SamplingParams& p) {
    if (!(p.temperature >= 0.0f) || !std::isfinite(p.temperature)) {
        throw InvalidArgument("[sampler] temperature must be a finite value >= 0 (0 = greedy), got " +
                              fmt_float(p.temperature));
    }
    if (!(p.top_p > 0.0f && p.top_p <= 1.0f)) {
        throw InvalidArgument("[sampler] top_p must be in (0, 1] (1 = disabled), got " + fmt_float(p.top_p));
    }
    if (!(p.min_p >= 0.0f && p.min_p <= 1.0f)) {
        throw InvalidArgument("[sampler] min_p must be in [0, 1] (0 = disabled), got " + fmt_float(p.min_p));
    }
    if (!(p.repeat_penalty > 0.0f) || !std::isfinite(p.repeat_penalty)) {
        throw InvalidArgument("[sampler] repeat_penalty must be a finite value > 0 (1 = disabled), got " +
                              fmt_float(p.repeat_penalty));
    }
    if (p.repeat_last_n < -1) {
        throw InvalidArgument(
            "[sampler] repeat_last_n must be >= -1 (-1 = all recent tokens, 0 = none), got " +
            std::to_string(p.repeat_last_n));
    }
}

struct Candidate {
    float logit;
    token_t id;
};

// Descending logit, ties to the lower id: the order every filter and the draw walk in.
bool higher_first(const Candidate& a, const Candidate& b) {
    return a.logit > b.logit || (a.logit == b.logit && a.id < b.id);
}

// Per-thread work buffers, grown to the largest vocabulary seen and never shrunk. Kept out of
// Sampler because its layout is fixed by the public header; per thread because several samplers
// may run on several threads.
struct Scratch {
    std::vector<float> logits;
    std::vector<Candidate> cand;
    std::vector<double> weight;
};

Scratch& scratch() {
    thread_local Scratch s;
    return s;
}

// Sorts cand just far enough that its first entries are the shortest prefix (in higher_first
// order) whose mass sum(exp(l - top)) reaches `threshold`, and returns that prefix's length, or
// cand.size() (everything sorted) if the whole set does not reach it. Grows the sorted prefix
// geometrically: LLM distributions put the nucleus in the first few hundred tokens, so this is
// O(n log k) instead of a full O(n log n) sort of the vocabulary.
size_t sort_nucleus(std::vector<Candidate>& cand, double top, double threshold) {
    size_t sorted = 0;
    double cum = 0.0;
    size_t k = std::min<size_t>(cand.size(), 256);
    for (;;) {
        std::partial_sort(cand.begin() + static_cast<std::ptrdiff_t>(sorted),
                          cand.begin() + static_cast<std::ptrdiff_t>(k), cand.end(), higher_first);
        for (size_t i = sorted; i < k; ++i) {
            cum += std::exp(static_cast<double>(cand[i].logit) - top);
            if (cum >= threshold) return i + 1;
        }
        if (k == cand.size()) return k;
        sorted = k;
        k = std::min(cand.size(), k * 8);
    }
}

}  // namespace

Sampler::Sampler(const SamplingParams& params) : params_(params), rng_state_(params.seed) {
    validate(params_);
}

token_t Sampler::sample(const float* logits, int64_t n_vocab, const std::vector<token_t>& recent_tokens) {
    if (n_vocab <= 0) {
        throw InvalidArgument("[sampler] n_vocab must be > 0, got " + std::to_string(n_vocab));
    }
    if (n_vocab > INT32_MAX) {
        throw InvalidArgument("[sampler] n_vocab " + std::to_string(n_vocab) + " does not fit a token id");
    }
    if (logits == nullptr) {
        throw InvalidArgument("[sampler] logits pointer is null");
    }

    // One branch-light pass first: !(v < +inf) is true for NaN and +inf alike; the slow search for
    // the culprit only runs when there is one.
    bool bad = false;
    for (int64_t i = 0; i < n_vocab; ++i) bad |= !(logits[i] < INFINITY);
    if (bad) {
        int64_t i = 0;
        while (logits[i] < INFINITY) ++i;
        throw InvalidArgument("[sampler] logit of token " + std::to_string(i) + " is " +
                              fmt_float(logits[i]) + " (only finite values and -inf are allowed)");
    }

    Scratch& buf = scratch();
    std::vector<float>& work = buf.logits;
    work.assign(logits, logits + n_vocab);

    // Repetition penalty, llama.cpp semantics: each distinct token of the window is penalized once,
    // however often it occurs; positive logits are divided, the others multiplied, so a penalty
    // > 1 always lowers the token's probability.
    if (params_.repeat_penalty != 1.0f && params_.repeat_last_n != 0 && !recent_tokens.empty()) {
        const size_t n_recent = recent_tokens.size();
        const size_t window = params_.repeat_last_n < 0
                                  ? n_recent
                                  : std::min(n_recent, static_cast<size_t>(params_.repeat_last_n));
        std::unordered_set<token_t> seen;
        for (size_t i = n_recent - window; i < n_recent; ++i) {
            const token_t t = recent_tokens[i];
            if (t < 0 || t >= n_vocab) {
                throw InvalidArgument("[sampler] recent token " + std::to_string(t) +
                                      " is outside the vocabulary [0, " + std::to_string(n_vocab) + ")");
            }
            if (!seen.insert(t).second) continue;
            float& l = work[static_cast<size_t>(t)];
            l = l > 0.0f ? l / params_.repeat_penalty : l * params_.repeat_penalty;
        }
    }

    // Argmax after the penalty; strict '>' keeps the first (lowest) id among equal maxima.
    size_t best = 0;
    float best_logit = work[0];
    for (size_t i = 1; i < work.size(); ++i) {
        if (work[i] > best_logit) {
            best_logit = work[i];
            best = i;
        }
    }
    if (best_logit == -INFINITY) {
        throw InvalidArgument("[sampler] all " + std::to_string(n_vocab) + " logits are -inf");
    }
    if (params_.temperature == 0.0f) return static_cast<token_t>(best);

    // Every token with non-zero probability is a candidate; -inf logits (masked tokens) never are.
    // cand starts in id order, which is itself a fixed order: when no filter below needs sorting,
    // the draw walks it as is.
    std::vector<Candidate>& cand = buf.cand;
    cand.clear();
    for (int64_t i = 0; i < n_vocab; ++i) {
        const float v = work[static_cast<size_t>(i)];
        if (v != -INFINITY) cand.push_back({v, static_cast<token_t>(i)});
    }

    // top-k: nth_element finds the k best in linear time; the set is exact under ties because
    // higher_first is a total order. Their order afterwards is the library's, so they get sorted.
    bool needs_sort = false;
    if (params_.top_k > 0 && static_cast<size_t>(params_.top_k) < cand.size()) {
        const auto kth = cand.begin() + (params_.top_k - 1);
        std::nth_element(cand.begin(), kth, cand.end(), higher_first);
        cand.resize(static_cast<size_t>(params_.top_k));
        needs_sort = true;
    }

    // Softmax at temperature 1 over the top-k set, in units of the max: p_i = exp(l_i - top) / total.
    // The max is always in the top-k set.
    const double top = static_cast<double>(best_logit);
    double total = 0.0;
    if (params_.top_p < 1.0f) {
        for (const Candidate& c : cand) total += std::exp(static_cast<double>(c.logit) - top);
    }

    // min-p before top-p, although llama.cpp runs it after: both keep a prefix of the sorted order
    // (min-p: every token with p >= min_p * p_max; top-p: the shortest prefix reaching top_p of
    // the top-k mass), two prefixes intersect to the shorter one, and top-p below still measures
    // against the full top-k mass `total`. So the result is llama.cpp's, while the sort that
    // follows usually sees a handful of tokens instead of the whole vocabulary. remove_if keeps
    // the relative order, so an unsorted cand stays in id order.
    if (params_.min_p > 0.0f) {
        const double min_log = std::log(static_cast<double>(params_.min_p));
        cand.erase(
            std::remove_if(cand.begin(), cand.end(),
                           [&](const Candidate& c) { return static_cast<double>(c.logit) - top < min_log; }),
            cand.end());
    }
    // cand is not empty: the max-logit token passes min-p (0 >= log(min_p)).

    if (params_.top_p < 1.0f) {
        // The token that crosses the threshold stays (as in llama.cpp), so at least one stays.
        cand.resize(sort_nucleus(cand, top, static_cast<double>(params_.top_p) * total));
    } else if (needs_sort) {
        std::sort(cand.begin(), cand.end(), higher_first);
    }

    // Temperature reshapes the survivors: weight_i = exp((l_i - top) / T).
    const double inv_t = 1.0 / static_cast<double>(params_.temperature);
    std::vector<double>& weight = buf.weight;
    weight.resize(cand.size());
    double sum = 0.0;
    for (size_t i = 0; i < cand.size(); ++i) {
        weight[i] = std::exp((static_cast<double>(cand[i].logit) - top) * inv_t);
        sum += weight[i];
    }

    // One uniform in [0, 1) from the top 53 bits; walk the cumulative weight in the fixed order.
    const uint64_t bits = splitmix64_next(rng_state_);
    const double u = static_cast<double>(bits >> 11) * (1.0 / 9007199254740992.0) * sum;
    double cum = 0.0;
    for (size_t i = 0; i < cand.size(); ++i) {
        cum += weight[i];
        if (u < cum) return cand[i].id;
    }
    return cand.back().id;  // rounding left u == sum: the last survivor
}

}  // namespace sharpi
