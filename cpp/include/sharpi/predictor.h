// The predictor plug-in interface (docs/design.md §6, docs/predictors.md): a predictor sees one MoE layer
// of the token being decoded and guesses which experts later layers will select. Its hints only
// decide what the expert cache reads early; they never change which experts compute, so no
// predictor can change a token or a logit.
//
// Threading: observe() is called on the decode thread only, once per MoE layer of each decoded
// token, in layer order, while the session's decode() runs. A step of a few rows (several
// sequences decoding together, a speculative verify step: 2..31 rows) calls it once per row at each
// MoE layer, rows in step order, layer by layer; prompts of 32 rows and more are not observed
// (they read ahead with the router's own guess and reach observe_context() afterwards). It must not call back
// into the session. An exception from observe() drops that call's hints; it is counted and kept
// (Session::predictor_errors()), and decoding goes on.
#pragma once

#include <cstdint>
#include <vector>

namespace sharpi {

struct PrefetchHint {
    int target_layer = 0;
    int32_t expert = 0;
    float score = 0.0f;  // higher = more confident; only the order among one layer's hints matters
};

// What a predictor sees at layer `layer` of the current token. Pointers are valid during the call.
struct PredictorInput {
    int layer = 0;
    int n_layer = 0, n_expert = 0, top_k = 0, n_embd = 0;
    const float* hidden = nullptr;         // [n_embd] residual entering the MoE block (before ffn_norm)
    const float* router_logits = nullptr;  // [n_expert] this layer's router output
    // [n_layer * top_k] row-major: the current token's selections of layers 0..layer (later rows are
    // -1), and the previous token's selections (all -1 when there is none).
    const int32_t* history = nullptr;
    const int32_t* prev = nullptr;
    int lookahead = 1;  // hints for layers layer+1 .. layer+lookahead are wanted
    // Hints per target layer the prefetcher can use (0: top_k). A predictor that scores every
    // expert gives its best this many; the byte-sized prefetcher asks for n_expert, to turn the
    // scores into probabilities (docs/predictors.md). Others may ignore it.
    int hints_per_layer = 0;
    // Which token of the step this is: its sequence (Session sequence id) and its row among the
    // step's n_rows observed rows. In a multi-row step a row after its sequence's first has for
    // `prev` the step's earlier row of that sequence, whose rows after `layer` are still -1.
    int32_t sequence = 0;
    int row = 0, n_rows = 1;
    // True when this token continues the sequence whose tokens the predictor's cross-token state
    // holds (what observe_context() and earlier `prev`s built) and `prev` is that sequence's last
    // completed token: a predictor that folds `prev` into that state at layer 0 may do so. Always
    // true for single-token decoding; in a multi-row step only for the first row of the sequence the
    // predictor follows. False: predict from this call's inputs and leave that state alone (the
    // engine hands the sequence's tokens over with observe_context() when it follows it again).
    bool updates_state = true;
    // [n_layer * top_k]: the experts this row's token chose at its latest earlier occurrence in the
    // sequence, after the same previous token when there is one (docs/speculative.md, "echo
    // guesses"); -1 where unknown. nullptr when the token never occurred (or no history is kept).
    const int32_t* echo = nullptr;
};

class Predictor {
  public:
    virtual ~Predictor() = default;
    virtual const char* name() const = 0;
    // Appends hints for layers in (in.layer, in.layer + in.lookahead]. Hints outside that range or
    // with an expert id outside [0, n_expert) are dropped and counted by the prefetcher.
    virtual void observe(const PredictorInput& in, std::vector<PrefetchHint>& hints) = 0;
    // The tokens of a batched decode (a prompt) that observe() never saw, oldest first: selections
    // [n_tokens * n_layer * top_k] (-1 = unknown). The batch's last token is not among them: it
    // reaches observe() as the next token's `prev`. `new_sequence`: the tokens start the sequence
    // (the session was empty or reset, or a truncate() rewound it: then they are the kept tokens
    // again), so whatever was kept is stale. Called on the decode thread after the batch, or before
    // the first token after a truncate(), and before the next observe(). Predictors that keep
    // per-sequence history fold the tokens in; the default ignores them.
    virtual void observe_context(const int32_t* /*selections*/, int64_t /*n_tokens*/, bool /*new_sequence*/) {
    }
};

}  // namespace sharpi
