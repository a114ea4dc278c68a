// The public entry point: load a GGUF model, decode tokens, sample.
//
// A Session owns one model and one KV cache. It is not thread-safe: one caller at a time
// (the Python bindings release the GIL around decode() but serialize calls per session), except
// cancel(), which any thread or a signal handler may call at any time.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "sharpi/errors.h"
#include "sharpi/options.h"
#include "sharpi/predictor.h"
#include "sharpi/types.h"

namespace sharpi {

class Model;
class Engine;

class Session {
  public:
    // Throws FormatError / UnsupportedError / MissingTensorError / IoError / InvalidArgument.
    Session(const std::string& model_path, const SessionOptions& options = {});
    ~Session();
    Session(const Session&) = delete;
    Session& operator=(const Session&) = delete;

    const ModelInfo& info() const;

    // Appends tokens at position n_past() and returns logits: [n_vocab] for the last token, or
    // [n_tokens * n_vocab] (row-major) when all_logits. Throws ContextOverflowError if the tokens
    // do not fit; in that case nothing is appended and the session is unchanged. rewindable: see
    // SequenceTokens (a speculative verify step that truncate() may cut back inside).
    std::vector<float> decode(const std::vector<token_t>& tokens, bool all_logits = false,
                              bool rewindable = false);

    // Stops the running decode(), or the next one if none runs, within one layer: it throws
    // CancelledError and appends nothing (n_past and the KV cache are as before the call). The
    // request is consumed by the decode that throws; reset() drops one that no decode has seen.
    // Lock-free and async-signal-safe.
    void cancel() noexcept;
    // Drops a cancel() that no decode has seen yet (a host starting a new request). Lock-free.
    void clear_cancel() noexcept;

    int64_t n_past() const;
    void reset();  // forget the KV cache (and a pending cancel())
    // Keeps the first n_keep positions of the sequence and forgets the rest, so a prompt sharing a
    // prefix with them decodes only the rest. Throws InvalidArgument unless 0 <= n_keep <= n_past(),
    // UnsupportedError for a model with recurrent state (qwen3next, qwen35moe) when n_keep < n_past(),
    // unless n_keep lies inside the last step and that step was rewindable.
    void truncate(int64_t n_keep);

    // ---- Several sequences at once (continuous batching) -------------------------------------
    // A session holds up to SessionOptions::n_seq sequences, each with its own positions and KV
    // cache. Sequence 0 always exists and is the one decode(), n_past(), reset() and truncate()
    // use. Ids are handles that are never reused (a removed sequence's id is InvalidArgument).
    //
    // A new empty sequence (InvalidArgument when n_seq exist).
    int32_t add_sequence();
    // A new sequence holding the first n_keep positions of `src` (its KV rows copied). On a model
    // with recurrent state only a whole fork (n_keep == n_past of src) is possible (UnsupportedError).
    int32_t fork_sequence(int32_t src, int64_t n_keep);
    // Frees a sequence and its KV cache (InvalidArgument for 0 or an unknown id).
    void remove_sequence(int32_t seq);
    std::vector<int32_t> sequences() const;
    int64_t n_past(int32_t seq) const;
    void reset(int32_t seq);
    void truncate(int32_t seq, int64_t n_keep);
    // One forward step over several sequences, each at most once: the dense matmuls and every
    // expert run once for all their tokens, attention per sequence. Returns, per entry, the logits
    // of its last token [n_vocab] or of all its tokens [n_tokens * n_vocab] (all_logits), bit for
    // bit what decoding that sequence alone gives; an entry dropped by cancel_sequence() gets an
    // empty vector and appends nothing. Validation (InvalidArgument, ContextOverflowError) happens
    // before anything is appended; cancel() stops the whole step (CancelledError, nothing appended).
    std::vector<std::vector<float>> decode_batch(const std::vector<SequenceTokens>& entries);
    // Speculative drafts from the file's multi-token-prediction block (SessionOptions::mtp): up to
    // n greedy tokens to follow `next`, the token `seq` decodes next, the block chained on its own
    // output. logits (optional): each draft position's [n_vocab] logits appended. The sequence is
    // unchanged. InvalidArgument without mtp, for an empty sequence, a bad token or n < 1.
    std::vector<token_t> draft_mtp(int32_t seq, token_t next, int n, std::vector<float>* logits = nullptr);
    // What a step decoding `tokens` on `seq` next would read from the file (StepReadEstimate), for
    // a speculative draft length chosen by what is resident. Reads and changes nothing; guesses
    // need a prefetcher (a predictor while streaming), else every token counts as unknown.
    // InvalidArgument for an unknown sequence or a token outside the vocabulary.
    StepReadEstimate predict_step_reads(int32_t seq, const std::vector<token_t>& tokens) const;
    // The tokens of `seq` in the running (or next) decode_batch that holds it are not appended;
    // the others are. On a model with recurrent state the sequence must then be reset. Lock-free.
    void cancel_sequence(int32_t seq) noexcept;

    // Activations recorded by the last decode() (empty unless dump_activations).
    const ActivationDump& dump() const;

    // Trace replay (benchmarks): the router follows recorded expert choices instead of its own top-k.
    // experts: [n_tokens, n_layers, top_k] row-major, -1 = missing (filled with the router's best
    // remaining experts). The token at position p uses row (p % n_tokens); the weights are the
    // router's own probabilities of the forced experts. Throws InvalidArgument when n_layers,
    // top_k or an id does not fit the model. An empty vector turns replay off.
    void set_route_trace(const std::vector<int32_t>& experts, int64_t n_tokens, int64_t n_layers,
                         int64_t top_k);

    // Experts each layer selected for the tokens of the last decode(): [n_layer][n_tokens * top_k],
    // in top-k rank order (empty for dense models).
    std::vector<std::vector<int32_t>> last_routing() const;

    // Spans recorded since creation or clear_timeline() when SessionOptions::timeline is set.
    std::vector<TimelineEvent> timeline_events() const;
    void clear_timeline();

    // Expert-cache counters (empty layers when every expert is resident); reset_stats() zeroes them.
    ExpertCacheStats expert_stats() const;
    void reset_stats();

    // Installs a host-written predictor (a session made with predictor = "custom"); nullptr removes
    // it. Throws InvalidArgument for a session without ram_budget or with another predictor.
    void set_predictor(std::shared_ptr<Predictor> predictor);
    // The last few messages of predictor calls that threw (their hints were dropped).
    std::vector<std::string> predictor_errors() const;

    // How ram_budget "auto" (SessionOptions::kRamBudgetAuto) was resolved when the session opened;
    // nothing when the session was given bytes.
    std::optional<AutoRamBudget> auto_ram_budget() const;

    // GGUF metadata as strings (arrays rendered as "[n items]") for hosts without the Python side.
    std::string metadata_string(const std::string& key) const;

  private:
    std::unique_ptr<Engine> engine_;
};

// Samples one token from logits. Stateless apart from its RNG; the caller passes the recent tokens
// for the repetition penalty. Throws InvalidArgument on out-of-range params.
class Sampler {
  public:
    explicit Sampler(const SamplingParams& params);
    token_t sample(const float* logits, int64_t n_vocab, const std::vector<token_t>& recent_tokens);
    const SamplingParams& params() const { return params_; }

  private:
    SamplingParams params_;
    uint64_t rng_state_;
};

}  // namespace sharpi
