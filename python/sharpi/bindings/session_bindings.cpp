// sharpi._core.Session: type conversion around sharpi::Session. Compute runs with the GIL
// released; a per-session mutex serialises Python threads that share one session.
//
// Lock order: the GIL is never held while waiting for the session mutex. decode() runs under the
// mutex and a Python predictor takes the GIL inside it (mutex -> GIL), so every method that touches
// the engine releases the GIL first, then locks (locked() below), copies what it needs into C++
// values, unlocks, and converts to Python objects with the GIL back. cancel() and clear_cancel()
// take no lock at all: they are how another thread stops a decode that holds the mutex.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <signal.h>

#include <atomic>
#include <cmath>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "bindings.h"
#include "sharpi/session.h"

namespace py = pybind11;

namespace sharpi::py_bindings {

namespace {

struct PySession {
    std::unique_ptr<Session> session;
    std::mutex mutex;
};

// Runs f() on the session under its mutex with the GIL released (see the lock order above); f must
// not touch Python objects. Returns what f returns.
template <class F>
auto locked(PySession& s, F&& f) {
    py::gil_scoped_release release;
    std::lock_guard<std::mutex> lock(s.mutex);
    return f(*s.session);
}

// A Python exception that is not an Exception (KeyboardInterrupt, SystemExit) raised inside a
// Python predictor's observe(): the host is asking to stop, so it unwinds decode() as a cancellation
// (the prefetcher passes CancelledError on instead of counting a predictor failure) and the decode
// binding raises the original Python exception. Destroyed only with the GIL held (the catch in
// decode) or by error_already_set's own GIL-taking deleter.
struct PythonInterrupt : CancelledError {
    explicit PythonInterrupt(py::error_already_set e)
        : CancelledError(std::string("decode cancelled by ") + e.what()), error(std::move(e)) {}
    py::error_already_set error;
};

// Ctrl-C during a decode on the main thread. CPython runs Python signal handlers only on the main
// thread between bytecodes, never while decode() computes without the GIL, so for the duration of
// the call a C handler owns SIGINT: it calls Session::cancel() (lock-free, async-signal-safe) and
// then the handler it replaced (CPython's, which records the signal for the interpreter). decode()
// stops within one layer and the binding runs the Python handler (PyErr_CheckSignals): normally
// KeyboardInterrupt. Armed only on the main thread and only when Python handles SIGINT (not SIG_DFL
// or SIG_IGN); the handler may run on any thread of the process.
class SigintBridge {
  public:
    explicit SigintBridge(Session& session) {  // with the GIL
        static const unsigned long main_ident =
            py::module_::import("threading").attr("main_thread")().attr("ident").cast<unsigned long>();
        if (PyThread_get_thread_ident() != main_ident || target_.load() != nullptr) return;
        struct sigaction current;
        if (::sigaction(SIGINT, nullptr, &current) != 0) return;
        const bool has_info = (current.sa_flags & SA_SIGINFO) != 0;
        if (!has_info && (current.sa_handler == SIG_DFL || current.sa_handler == SIG_IGN)) return;
        previous_ = current;
        fired_.store(false);
        target_.store(&session);
        struct sigaction mine = current;
        mine.sa_flags = (current.sa_flags | SA_SIGINFO) & ~SA_RESETHAND;
        mine.sa_sigaction = &SigintBridge::handle;
        if (::sigaction(SIGINT, &mine, nullptr) != 0) {
            target_.store(nullptr);
            return;
        }
        armed_ = true;
    }
    ~SigintBridge() {
        if (!armed_) return;
        ::sigaction(SIGINT, &previous_, nullptr);
        target_.store(nullptr);
    }
    SigintBridge(const SigintBridge&) = delete;
    SigintBridge& operator=(const SigintBridge&) = delete;

    bool fired() const { return armed_ && fired_.load(); }

  private:
    static void handle(int sig, siginfo_t* info, void* context) {
        if (Session* s = target_.load()) {
            s->cancel();
            fired_.store(true);
        }
        if (previous_.sa_flags & SA_SIGINFO) {
            previous_.sa_sigaction(sig, info, context);
        } else if (previous_.sa_handler != SIG_DFL && previous_.sa_handler != SIG_IGN) {
            previous_.sa_handler(sig);
        }
    }

    static inline std::atomic<Session*> target_{nullptr};
    static inline std::atomic<bool> fired_{false};
    static inline struct sigaction previous_{};
    bool armed_ = false;
    static_assert(std::atomic<Session*>::is_always_lock_free && std::atomic<bool>::is_always_lock_free,
                  "the SIGINT handler may only use lock-free atomics");
};

// Moves a vector into a numpy array without copying (the capsule owns it).
py::array_t<float> to_numpy(std::vector<float>&& v, std::vector<py::ssize_t> shape) {
    auto* owned = new std::vector<float>(std::move(v));
    py::capsule free_when_done(owned, [](void* p) { delete static_cast<std::vector<float>*>(p); });
    return py::array_t<float>(shape, owned->data(), free_when_done);
}

py::dict info_dict(const ModelInfo& i) {
    py::dict d;
    d["path"] = i.path;
    d["arch"] = i.arch;
    d["name"] = i.name;
    d["n_vocab"] = i.n_vocab;
    d["n_embd"] = i.n_embd;
    d["n_layer"] = i.n_layer;
    d["n_head"] = i.n_head;
    d["n_head_kv"] = i.n_head_kv;
    d["head_dim"] = i.head_dim;
    d["n_ff"] = i.n_ff;
    d["n_ff_exp"] = i.n_ff_exp;
    d["n_ff_shexp"] = i.n_ff_shexp;
    d["n_layer_dense_lead"] = i.n_layer_dense_lead;
    d["n_expert"] = i.n_expert;
    d["n_expert_used"] = i.n_expert_used;
    d["n_ctx_train"] = i.n_ctx_train;
    d["n_ctx"] = i.n_ctx;
    d["n_seq"] = i.n_seq;
    d["max_step_tokens"] = i.max_step_tokens;
    d["max_draft_tokens"] = i.max_draft_tokens;
    d["recurrent"] = i.recurrent;
    d["n_layer_nextn"] = i.n_layer_nextn;
    d["mtp"] = i.mtp;
    d["cache_type_k"] = i.cache_type_k;
    d["cache_type_v"] = i.cache_type_v;
    d["bytes_kv"] = i.bytes_kv;
    d["bytes_dense"] = i.bytes_dense;
    d["bytes_experts"] = i.bytes_experts;
    return d;
}

// A read-only numpy view of engine memory, valid only during the Python call it is passed to (the
// engine keeps owning it; no copy).
template <typename T>
py::array_t<T> borrowed_view(const T* p, std::vector<py::ssize_t> shape) {
    py::array_t<T> a(std::move(shape), p, py::none());
    py::detail::array_proxy(a.ptr())->flags &= ~py::detail::npy_api::NPY_ARRAY_WRITEABLE_;
    return a;
}

// Runs a decode (decode or decode_batch) under the session's lock with Ctrl-C bridged to cancel():
// a Python error raised inside (a predictor's) is re-raised as itself; a Ctrl-C that cancelled the
// decode lets Python's handler speak (KeyboardInterrupt unless the script installed its own), while
// a cancel() from another thread stays CancelledError.
template <typename F>
auto decode_interruptibly(PySession& s, F&& f) {
    SigintBridge sigint(*s.session);
    try {
        auto result = locked(s, std::forward<F>(f));
        // A Ctrl-C after the last check: the call completed, Python raises the KeyboardInterrupt on
        // its own, and the next decode must not be cancelled.
        if (sigint.fired()) s.session->clear_cancel();
        return result;
    } catch (PythonInterrupt& e) {
        throw py::error_already_set(e.error);
    } catch (const CancelledError&) {
        if (sigint.fired() && PyErr_CheckSignals() != 0) throw py::error_already_set();
        throw;
    }
}

// A Python object with an observe() method as a sharpi::Predictor (docs/predictors.md). The decode
// thread runs without the GIL; each call takes it, hands numpy views of the engine's buffers (no
// copies, read-only, valid during the call) and converts the returned hints. A Python exception
// becomes a C++ exception carrying its text, which the prefetcher counts and drops. An object with
// an observe_context() method also gets a batched prompt's tokens (Predictor::observe_context);
// an observe() with a `step` parameter (or **kwargs) gets the row's place in a multi-row step as
// sharpi.plugin.StepRow (PredictorInput::sequence / row / n_rows / updates_state).
class PyPredictor final : public Predictor {
  public:
    // n_layer, top_k: the model's, the shape of observe_context's selections.
    PyPredictor(py::object obj, int64_t n_layer, int64_t top_k)
        : obj_(std::move(obj)), n_layer_(n_layer), top_k_(top_k) {
        name_ = py::str(py::type::of(obj_).attr("__name__")).cast<std::string>();
        has_context_ = py::hasattr(obj_, "observe_context");
        py::module_ plugin = py::module_::import("sharpi.plugin");
        step_row_ = plugin.attr("StepRow");
        takes_step_ = plugin.attr("observe_takes_step")(obj_).cast<bool>();
    }
    ~PyPredictor() override {
        py::gil_scoped_acquire gil;
        obj_ = py::object();
        step_row_ = py::object();
    }
    const char* name() const override { return name_.c_str(); }

    void observe_context(const int32_t* selections, int64_t n_tokens, bool new_sequence) override {
        if (!has_context_) return;
        py::gil_scoped_acquire gil;
        call_python([&] {
            obj_.attr("observe_context")(borrowed_view(selections, {static_cast<py::ssize_t>(n_tokens),
                                                                    static_cast<py::ssize_t>(n_layer_),
                                                                    static_cast<py::ssize_t>(top_k_)}),
                                         new_sequence);
        });
    }

    void observe(const PredictorInput& in, std::vector<PrefetchHint>& hints) override {
        py::gil_scoped_acquire gil;
        call_python([&] {
            const std::vector<py::ssize_t> rows{static_cast<py::ssize_t>(in.n_layer),
                                                static_cast<py::ssize_t>(in.top_k)};
            py::object observe = obj_.attr("observe");
            py::object out;
            if (takes_step_) {
                out = observe(in.layer, borrowed_view(in.hidden, {in.n_embd}),
                              borrowed_view(in.router_logits, {in.n_expert}), borrowed_view(in.history, rows),
                              borrowed_view(in.prev, rows),
                              py::arg("step") = step_row_(in.sequence, in.row, in.n_rows, in.updates_state,
                                                          in.echo ? py::object(borrowed_view(in.echo, rows))
                                                                  : py::object(py::none())));
            } else {
                out = observe(in.layer, borrowed_view(in.hidden, {in.n_embd}),
                              borrowed_view(in.router_logits, {in.n_expert}), borrowed_view(in.history, rows),
                              borrowed_view(in.prev, rows));
            }
            if (out.is_none()) return;
            py::array_t<double, py::array::c_style | py::array::forcecast> arr =
                py::module_::import("numpy").attr("asarray")(out, "float64");
            if (arr.size() == 0) return;
            if (arr.ndim() != 2 || arr.shape(1) != 3) {
                throw InvalidArgument(
                    "observe() must return (target_layer, expert, score) triples, got an array of shape " +
                    std::string(py::str(py::tuple(
                        py::cast(std::vector<py::ssize_t>(arr.shape(), arr.shape() + arr.ndim()))))));
            }
            const double* d = arr.data();
            for (py::ssize_t i = 0; i < arr.shape(0); ++i) {
                const double t = d[3 * i], e = d[3 * i + 1];
                // Non-integral or huge ids become -1: out of range, so the prefetcher drops and counts them.
                const bool ok_t = std::isfinite(t) && t == std::floor(t) && std::fabs(t) < 1e9;
                const bool ok_e = std::isfinite(e) && e == std::floor(e) && std::fabs(e) < 1e9;
                hints.push_back(PrefetchHint{ok_t ? static_cast<int>(t) : -1,
                                             ok_e ? static_cast<int32_t>(e) : -1,
                                             static_cast<float>(d[3 * i + 2])});
            }
        });
    }

  private:
    // Runs `body` (holding the GIL): a Python Exception becomes a std::runtime_error with its text
    // (the prefetcher counts it and drops the call's hints); KeyboardInterrupt / SystemExit cancel.
    template <typename Body>
    void call_python(Body&& body) {
        std::string error;
        try {
            body();
        } catch (py::error_already_set& e) {
            if (!e.matches(PyExc_Exception)) throw PythonInterrupt(std::move(e));
            error = e.what();  // read while holding the GIL; the exception object dies here too
        }
        if (!error.empty()) throw std::runtime_error(error);
    }

    py::object obj_, step_row_;
    std::string name_;
    int64_t n_layer_, top_k_;
    bool has_context_ = false, takes_step_ = false;
};

// A non-negative Python int as bytes; InvalidArgument naming `what` otherwise.
uint64_t non_negative_bytes(const py::object& value, const char* what) {
    if (PyObject_RichCompareBool(value.ptr(), py::int_(0).ptr(), Py_LT) == 1) {
        throw InvalidArgument(std::string(what) + " must be bytes >= 0, a size with units or 'auto', got " +
                              py::repr(value).cast<std::string>());
    }
    return value.cast<uint64_t>();
}

// vram_budget as a host writes it: None (none), bytes, or a size with units or "auto" (parse_budget).
uint64_t vram_budget_bytes(const py::object& value) {
    if (value.is_none()) return 0;
    if (py::isinstance<py::str>(value)) return parse_budget(value.cast<std::string>());
    if (py::isinstance<py::bool_>(value) || !py::isinstance<py::int_>(value)) {
        throw InvalidArgument("vram_budget must be bytes >= 0, a size with units or 'auto', got " +
                              py::repr(value).cast<std::string>());
    }
    return non_negative_bytes(value, "vram_budget");
}

// ram_budget as a host writes it: anything false (None, 0, "") is none, bytes, a size with units or
// "auto" (parse_budget; any other object by its str()).
uint64_t ram_budget_bytes(const py::object& value) {
    if (py::isinstance<py::str>(value)) {
        const std::string text = value.cast<std::string>();
        return text.empty() ? 0 : parse_budget(text);
    }
    if (!PyObject_IsTrue(value.ptr())) return 0;
    if (py::isinstance<py::int_>(value) && !py::isinstance<py::bool_>(value))
        return non_negative_bytes(value, "ram_budget");
    return parse_byte_size(py::str(value).cast<std::string>());
}

}  // namespace

void bind_session(py::module_& m) {
    m.def("parse_byte_size", &parse_byte_size, py::arg("text"),
          "\"6GiB\" -> 6442450944 (InvalidArgument if malformed)");
    // Session(vram_budget=VRAM_BUDGET_AUTO): free VRAM minus a margin (SessionOptions::kVramBudgetAuto).
    m.attr("VRAM_BUDGET_AUTO") = SessionOptions::kVramBudgetAuto;
    py::class_<PySession>(m, "Session")
        .def(
            py::init([](const std::string& path, int threads, int n_ctx, int n_seq, bool exact,
                        bool dump_activations, const py::object& ram_budget, double slru_probation,
                        const std::string& reader, bool timeline, const std::string& predictor,
                        const std::string& predictor_file, int lookahead, bool skip_late_prefetch,
                        const std::string& prefetch_sizing, const std::string& cache_policy,
                        const std::string& cache_policy_file, const std::string& cache_type_k,
                        const std::string& cache_type_v, bool allow_long_context, const std::string& device,
                        const py::object& vram_budget, const std::string& miss_route,
                        double miss_copy_bytes_per_s, double miss_copy_latency_s, double miss_cpu_bytes_per_s,
                        int max_draft_tokens, bool mtp, const std::string& mtp_file) {
                SessionOptions o;
                o.n_threads = threads;
                o.n_ctx = n_ctx;
                o.n_seq = n_seq;
                o.max_draft_tokens = max_draft_tokens;
                o.mtp = mtp;
                o.mtp_file = mtp_file;
                o.exact = exact;
                o.dump_activations = dump_activations;
                o.ram_budget = ram_budget_bytes(ram_budget);
                o.slru_probation = slru_probation;
                o.reader = reader;
                o.timeline = timeline;
                o.predictor = predictor;
                o.predictor_file = predictor_file;
                o.lookahead = lookahead;
                o.skip_late_prefetch = skip_late_prefetch;
                o.prefetch_sizing = prefetch_sizing;
                o.cache_policy = cache_policy;
                o.cache_policy_file = cache_policy_file;
                o.cache_type_k = cache_type_k;
                o.cache_type_v = cache_type_v;
                o.allow_long_context = allow_long_context;
                o.device = device;
                o.vram_budget = vram_budget_bytes(vram_budget);
                o.miss_route = miss_route;
                o.miss_copy_bytes_per_s = miss_copy_bytes_per_s;
                o.miss_copy_latency_s = miss_copy_latency_s;
                o.miss_cpu_bytes_per_s = miss_cpu_bytes_per_s;
                auto s = std::make_unique<PySession>();
                py::gil_scoped_release release;
                s->session = std::make_unique<Session>(path, o);
                return s;
            }),
            py::arg("path"), py::arg("threads") = 0, py::arg("n_ctx") = 0, py::arg("n_seq") = 1,
            py::arg("exact") = false, py::arg("dump_activations") = false, py::arg("ram_budget") = py::none(),
            py::arg("slru_probation") = 0.25, py::arg("reader") = "auto", py::arg("timeline") = false,
            py::arg("predictor") = "none", py::arg("predictor_file") = "", py::arg("lookahead") = 1,
            py::arg("skip_late_prefetch") = true, py::arg("prefetch_sizing") = "topk",
            py::arg("cache_policy") = "", py::arg("cache_policy_file") = "", py::arg("cache_type_k") = "",
            py::arg("cache_type_v") = "", py::arg("allow_long_context") = false, py::arg("device") = "cpu",
            py::arg("vram_budget") = py::none(), py::arg("miss_route") = "copy",
            py::arg("miss_copy_bytes_per_s") = 0.0, py::arg("miss_copy_latency_s") = -1.0,
            py::arg("miss_cpu_bytes_per_s") = 0.0, py::arg("max_draft_tokens") = 0, py::arg("mtp") = false,
            py::arg("mtp_file") = "")
        .def_property_readonly("info", [](PySession& s) { return info_dict(s.session->info()); })
        .def_property_readonly(
            "auto_ram_budget",
            [](PySession& s) -> py::object {
                const std::optional<AutoRamBudget> a = s.session->auto_ram_budget();
                if (!a) return py::none();
                py::dict d;
                d["budget"] = a->budget;
                d["available"] = a->available;
                d["margin"] = a->margin;
                d["source"] = a->source;
                d["summary"] = a->describe();
                return std::move(d);
            },
            "How ram_budget=\"auto\" was resolved (budget, available, margin, source, summary), or None")
        .def_property_readonly("n_past",
                               [](PySession& s) { return locked(s, [](Session& x) { return x.n_past(); }); })
        .def(
            "decode",
            [](PySession& s, std::vector<token_t> tokens, bool all_logits, bool rewindable) {
                const int64_t n_vocab = s.session->info().n_vocab;
                std::vector<float> logits = decode_interruptibly(
                    s, [&](Session& x) { return x.decode(tokens, all_logits, rewindable); });
                if (all_logits) {
                    return to_numpy(std::move(logits), {static_cast<py::ssize_t>(tokens.size()), n_vocab});
                }
                return to_numpy(std::move(logits), {n_vocab});
            },
            py::arg("tokens"), py::arg("all_logits") = false, py::arg("rewindable") = false,
            "Append tokens and return f32 logits: [n_vocab] for the last token or [n_tokens, n_vocab]. "
            "rewindable: truncate() may cut back inside these tokens (a speculative verify step).")
        .def(
            "draft_mtp",
            [](PySession& s, int32_t seq, token_t next, int n, bool with_logits) -> py::tuple {
                const int64_t n_vocab = s.session->info().n_vocab;
                std::vector<float> logits;
                std::vector<token_t> tokens = locked(s, [&](Session& x) {
                    return x.draft_mtp(seq, next, n, with_logits ? &logits : nullptr);
                });
                if (!with_logits) return py::make_tuple(tokens, py::none());
                const py::ssize_t rows = static_cast<py::ssize_t>(tokens.size());
                return py::make_tuple(tokens, to_numpy(std::move(logits), {rows, n_vocab}));
            },
            py::arg("seq"), py::arg("next"), py::arg("n"), py::arg("with_logits") = false,
            "Up to n greedy draft tokens after `next` from the MTP head (mtp=True): (tokens, logits "
            "[n, n_vocab] or None).")
        .def(
            "predict_step_reads",
            [](PySession& s, int32_t seq, const std::vector<token_t>& tokens) {
                const StepReadEstimate r =
                    locked(s, [&](Session& x) { return x.predict_step_reads(seq, tokens); });
                py::dict d;
                d["bytes"] = r.bytes;
                d["bytes_per_ms"] = r.bytes_per_ms;
                return d;
            },
            py::arg("seq"), py::arg("tokens"),
            "What a step of `tokens` on sequence `seq` would read: {'bytes': [the bytes of a step of "
            "the first j + 1 tokens, for each j], 'bytes_per_ms': the reader's measured bandwidth}.")
        .def(
            "decode_batch",
            [](PySession& s,
               const std::vector<std::tuple<int32_t, std::vector<token_t>, bool, bool>>& entries) {
                const int64_t n_vocab = s.session->info().n_vocab;
                std::vector<SequenceTokens> step;
                for (const auto& [seq, tokens, all_logits, rewindable] : entries)
                    step.push_back({seq, tokens, all_logits, rewindable});
                std::vector<std::vector<float>> logits =
                    decode_interruptibly(s, [&](Session& x) { return x.decode_batch(step); });
                py::list out;
                for (size_t e = 0; e < step.size(); ++e) {
                    const py::ssize_t rows = static_cast<py::ssize_t>(logits[e].size()) / n_vocab;
                    if (step[e].all_logits || logits[e].empty())
                        out.append(to_numpy(std::move(logits[e]), {rows, n_vocab}));
                    else
                        out.append(to_numpy(std::move(logits[e]), {n_vocab}));
                }
                return out;
            },
            py::arg("entries"),
            "One step over several sequences: entries [(seq, tokens, all_logits, rewindable)]; per entry f32 "
            "logits "
            "[n_vocab] or [n_tokens, n_vocab], [0, n_vocab] when cancel_sequence() dropped it.")
        .def(
            "add_sequence",
            [](PySession& s) { return locked(s, [](Session& x) { return x.add_sequence(); }); },
            "A new empty sequence's id (InvalidArgument when n_seq sequences exist).")
        .def(
            "fork_sequence",
            [](PySession& s, int32_t src, int64_t n_keep) {
                return locked(s, [&](Session& x) { return x.fork_sequence(src, n_keep); });
            },
            py::arg("src"), py::arg("n_keep"), "A new sequence holding the first n_keep positions of src.")
        .def(
            "remove_sequence",
            [](PySession& s, int32_t seq) { locked(s, [&](Session& x) { x.remove_sequence(seq); }); },
            py::arg("seq"))
        .def("sequences", [](PySession& s) { return locked(s, [](Session& x) { return x.sequences(); }); })
        .def(
            "sequence_n_past",
            [](PySession& s, int32_t seq) { return locked(s, [&](Session& x) { return x.n_past(seq); }); },
            py::arg("seq"))
        .def(
            "reset_sequence", [](PySession& s, int32_t seq) { locked(s, [&](Session& x) { x.reset(seq); }); },
            py::arg("seq"))
        .def(
            "truncate_sequence",
            [](PySession& s, int32_t seq, int64_t n_keep) {
                locked(s, [&](Session& x) { x.truncate(seq, n_keep); });
            },
            py::arg("seq"), py::arg("n_keep"))
        .def(
            "cancel_sequence", [](PySession& s, int32_t seq) { s.session->cancel_sequence(seq); },
            py::arg("seq"),
            "The tokens of seq in the running (or next) decode_batch are not appended; any thread, no lock.")
        .def(
            "cancel", [](PySession& s) { s.session->cancel(); },
            "Stop the running decode (or the next one) within one layer with CancelledError; any thread, "
            "no lock.")
        .def(
            "clear_cancel", [](PySession& s) { s.session->clear_cancel(); },
            "Drop a cancel() that no decode has seen yet.")
        .def("reset", [](PySession& s) { locked(s, [](Session& x) { x.reset(); }); })
        .def(
            "truncate",
            [](PySession& s, int64_t n_keep) { locked(s, [&](Session& x) { x.truncate(n_keep); }); },
            py::arg("n_keep"),
            "Keep the first n_keep positions; UnsupportedError where recurrent state cannot rewind.")
        .def("dump",
             [](PySession& s) {
                 ActivationDump acts = locked(s, [](Session& x) { return x.dump(); });
                 py::dict d;
                 for (auto& [name, act] : acts) {
                     std::vector<py::ssize_t> shape(act.shape.begin(), act.shape.end());
                     d[py::str(name)] = to_numpy(std::move(act.data), shape);
                 }
                 return d;
             })
        .def(
            "set_route_trace",
            [](PySession& s, py::array_t<int32_t, py::array::c_style | py::array::forcecast> experts) {
                if (experts.size() == 0) {
                    locked(s, [](Session& x) { x.set_route_trace({}, 0, 0, 0); });
                    return;
                }
                if (experts.ndim() != 3) {
                    throw InvalidArgument("route trace must be a 3-D array [tokens, layers, top_k], got " +
                                          std::to_string(experts.ndim()) + " dimensions");
                }
                std::vector<int32_t> flat(experts.data(), experts.data() + experts.size());
                const py::ssize_t n_tokens = experts.shape(0), n_layers = experts.shape(1),
                                  k = experts.shape(2);
                locked(s, [&](Session& x) { x.set_route_trace(flat, n_tokens, n_layers, k); });
            },
            py::arg("experts"))
        .def("last_routing",
             [](PySession& s) {
                 py::list out;
                 const int64_t k = s.session->info().n_expert_used;
                 for (std::vector<int32_t>& ids : locked(s, [](Session& x) { return x.last_routing(); })) {
                     const py::ssize_t n = k > 0 ? static_cast<py::ssize_t>(ids.size()) / k : 0;
                     out.append(py::array_t<int32_t>({n, static_cast<py::ssize_t>(k)}, ids.data()));
                 }
                 return out;
             })
        .def("timeline_events",
             [](PySession& s) {
                 py::list out;
                 for (const TimelineEvent& e : locked(s, [](Session& x) { return x.timeline_events(); })) {
                     py::dict d;
                     d["track"] = e.track;
                     d["name"] = e.name;
                     d["start_us"] = e.start_us;
                     d["dur_us"] = e.dur_us;
                     out.append(d);
                 }
                 return out;
             })
        .def("clear_timeline", [](PySession& s) { locked(s, [](Session& x) { x.clear_timeline(); }); })
        .def("expert_stats",
             [](PySession& s) { return stats_dict(locked(s, [](Session& x) { return x.expert_stats(); })); })
        .def("reset_stats", [](PySession& s) { locked(s, [](Session& x) { x.reset_stats(); }); })
        .def(
            "set_predictor",
            [](PySession& s, py::object predictor) {
                std::shared_ptr<Predictor> p;
                if (!predictor.is_none()) {
                    if (!py::hasattr(predictor, "observe")) {
                        throw InvalidArgument(
                            "predictor object has no observe() method (subclass sharpi.Predictor)");
                    }
                    const ModelInfo& info = s.session->info();
                    p = std::make_shared<PyPredictor>(predictor, info.n_layer, info.n_expert_used);
                }
                locked(s, [&](Session& x) { x.set_predictor(std::move(p)); });
            },
            py::arg("predictor"))
        .def("predictor_errors",
             [](PySession& s) { return locked(s, [](Session& x) { return x.predictor_errors(); }); })
        .def("metadata_string",
             [](PySession& s, const std::string& key) { return s.session->metadata_string(key); });
}

}  // namespace sharpi::py_bindings
