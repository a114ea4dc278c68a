// sharpi._internal.ReplacementPolicy and replay_policy: the expert cache's replacement policies
// (cpp/src/moe/replacement_policy.h, moe/policy_replay.h) seen from Python, so trace replay and
// Belady comparisons (python/sharpi/belady.py, python/sharpi/cache_eval.py) run the engine's own
// policy code. Type conversion only.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "cpu/ops/matmul.h"
#include "gguf/cache_prior_file.h"
#include "internal.h"
#include "model/model.h"
#include "moe/expert_cache.h"
#include "moe/expert_tier.h"
#include "moe/policy_replay.h"
#include "moe/replacement_policy.h"
#include "sharpi/errors.h"

namespace py = pybind11;

namespace sharpi::py_bindings {

namespace {

template <typename T>
std::vector<T> to_vector(const py::object& o) {
    if (o.is_none()) return {};
    auto a = py::array_t<T, py::array::c_style | py::array::forcecast>::ensure(o);
    if (!a) throw py::type_error("expected an array of numbers");
    return std::vector<T>(a.data(), a.data() + a.size());
}

// One ExpertCache over a mapped model in a chosen tier ("ram": the file reader into an anonymous
// mapping, as a streaming session; "copy": the VRAM tier's fill path in host memory), driven step by
// step as the MoE FFN drives it, so tests compare tiers on the same access sequence.
class TierCacheTest {
  public:
    TierCacheTest(const std::string& path, const std::string& tier, uint64_t n_slots, uint64_t n_staging,
                  const std::string& policy, const std::string& reader)
        : model_(load_model(path, /*streaming=*/false)) {
        ExpertCacheOptions o;
        o.n_slots = n_slots;
        o.n_staging = n_staging;
        o.policy = policy;
        o.reader = reader;
        if (tier == "ram") {
            cache_ = std::make_unique<ExpertCache>(model_->experts, o);
        } else if (tier == "copy") {
            cache_ =
                std::make_unique<ExpertCache>(model_->experts, o, copy_tier(mapped_images(model_->experts)));
        } else {
            throw InvalidArgument("TierCacheTest: tier must be 'ram' or 'copy', got '" + tier + "'");
        }
    }
    // One layer step: gate, acquire, wait, then each expert's gate | up | down bytes as the cache hands
    // them to compute.
    std::vector<py::bytes> step(int il, const std::vector<int32_t>& experts) {
        const int n = static_cast<int>(experts.size());
        std::vector<ExpertView> views(experts.size());
        cache_->gate_fired(il, experts.data(), n);
        cache_->acquire(il, experts.data(), n, views.data());
        std::vector<py::bytes> out;
        for (int i = 0; i < n; ++i) {
            cache_->wait(i);
            std::string bytes;
            for (const cpu::WeightView* w : {&views[i].gate, &views[i].up, &views[i].down}) {
                bytes.append(reinterpret_cast<const char*>(w->data),
                             static_cast<size_t>(w->n_rows) * w->row_bytes);
            }
            out.emplace_back(bytes);
        }
        cache_->release(il);
        return out;
    }
    std::string prefetch(int il, int32_t e) {
        switch (cache_->prefetch(il, e)) {
            case ExpertCache::PrefetchOutcome::issued:
                return "issued";
            case ExpertCache::PrefetchOutcome::present:
                return "present";
            case ExpertCache::PrefetchOutcome::no_slot:
                return "no_slot";
        }
        return "";
    }
    void drain() { cache_->drain(); }
    py::dict stats() const { return stats_dict(cache_->stats()); }

  private:
    std::unique_ptr<Model> model_;
    std::unique_ptr<ExpertCache> cache_;  // after the model: destroyed first
};

}  // namespace

void bind_cache(py::module_& m) {
    py::class_<TierCacheTest>(
        m, "TierCacheTest",
        "One expert cache in a tier ('ram' or 'copy') over a mapped model, driven step by step")
        .def(py::init<const std::string&, const std::string&, uint64_t, uint64_t, const std::string&,
                      const std::string&>(),
             py::arg("path"), py::arg("tier"), py::arg("n_slots"), py::arg("n_staging") = 0,
             py::arg("policy") = "slru", py::arg("reader") = "pread")
        .def("step", &TierCacheTest::step, py::arg("layer"), py::arg("experts"))
        .def("prefetch", &TierCacheTest::prefetch, py::arg("layer"), py::arg("expert"))
        .def("drain", &TierCacheTest::drain)
        .def("stats", &TierCacheTest::stats);
    py::class_<ReplacementPolicy, std::unique_ptr<ReplacementPolicy>>(
        m, "ReplacementPolicy",
        "An expert-cache replacement policy over slot ids (small ints the caller hands out).\n"
        "ReplacementPolicy(name, capacity, probation=0.25, lfu_half_life=0 (4 x capacity), "
        "s3fifo_small=0.1,\n"
        "prior=None, prior_pin=0.5): name from replacement_policy_names(); probation: SLRU's\n"
        "probation share in (0, 1] (1 = plain LRU); prior: float [n_layer, n_expert] for 'prior'.")
        .def(py::init([](const std::string& name, uint64_t capacity, double probation, double lfu_half_life,
                         double s3fifo_small, const py::object& prior, double prior_pin) {
                 ReplacementPolicyOptions options;
                 options.probation = probation;
                 options.lfu_half_life = lfu_half_life;
                 options.s3fifo_small = s3fifo_small;
                 options.prior_pin = prior_pin;
                 if (!prior.is_none()) {
                     auto a = py::array_t<float, py::array::c_style | py::array::forcecast>::ensure(prior);
                     if (!a || a.ndim() != 2)
                         throw py::type_error("prior must be a 2-D array [n_layer, n_expert]");
                     options.n_layer = a.shape(0);
                     options.n_expert = a.shape(1);
                     options.prior.assign(a.data(), a.data() + a.size());
                 }
                 return make_replacement_policy(name, capacity, options);
             }),
             py::arg("name"), py::arg("capacity"), py::arg("probation") = 0.25,
             py::arg("lfu_half_life") = 0.0, py::arg("s3fifo_small") = 0.1, py::arg("prior") = py::none(),
             py::arg("prior_pin") = 0.5)
        .def_property_readonly("name", [](const ReplacementPolicy& p) { return std::string(p.name()); })
        .def(
            "insert",
            [](ReplacementPolicy& p, uint32_t slot, int32_t layer, int32_t expert) {
                p.insert(slot, ExpertKey{layer, expert});
            },
            py::arg("slot"), py::arg("layer") = 0, py::arg("expert") = 0,
            "slot now caches expert (layer, expert) (a miss filled)")
        .def("touch", &ReplacementPolicy::touch, py::arg("slot"), "a cached slot was used again (a hit)")
        .def("remove", &ReplacementPolicy::remove, py::arg("slot"), "slot left the cache (evicted)")
        .def("gate", &ReplacementPolicy::gate, py::arg("layer"), "layer's gate fired")
        .def("protect", &ReplacementPolicy::protect, py::arg("slot"), py::arg("layer"),
             "the predictor expects cached slot to be needed at layer's gate")
        .def("__contains__", &ReplacementPolicy::contains, py::arg("slot"))
        .def("__len__", &ReplacementPolicy::size)
        .def(
            "victim",
            [](ReplacementPolicy& p, std::vector<uint32_t> pinned) -> py::object {
                std::sort(pinned.begin(), pinned.end());
                const uint32_t v = p.victim(
                    [&](uint32_t s) { return !std::binary_search(pinned.begin(), pinned.end(), s); });
                return v == ReplacementPolicy::kNone ? py::object(py::none()) : py::object(py::int_(v));
            },
            py::arg("pinned") = std::vector<uint32_t>{},
            "The slot the policy evicts next, skipping `pinned` (None when every cached slot is pinned); "
            "does not evict it");
    m.def("replacement_policy_names", &replacement_policy_names);
    m.def("default_replacement_policy", []() { return std::string(default_replacement_policy()); });
    m.def(
        "replay_policy",
        [](ReplacementPolicy& policy, uint64_t capacity, const py::object& layer, const py::object& offsets,
           const py::object& experts, const py::object& hint_offsets, const py::object& hint_layer,
           const py::object& hint_expert) {
            ReplaySteps steps;
            steps.layer = to_vector<int32_t>(layer);
            steps.offsets = to_vector<int64_t>(offsets);
            steps.experts = to_vector<int32_t>(experts);
            steps.hint_offsets = to_vector<int64_t>(hint_offsets);
            steps.hint_layer = to_vector<int32_t>(hint_layer);
            steps.hint_expert = to_vector<int32_t>(hint_expert);
            std::vector<uint32_t> misses;
            {
                py::gil_scoped_release release;
                misses = replay_policy(policy, capacity, steps);
            }
            py::array_t<uint32_t> out(static_cast<py::ssize_t>(misses.size()));
            std::copy(misses.begin(), misses.end(), out.mutable_data());
            return out;
        },
        py::arg("policy"), py::arg("capacity"), py::arg("layer"), py::arg("offsets"), py::arg("experts"),
        py::arg("hint_offsets") = py::none(), py::arg("hint_layer") = py::none(),
        py::arg("hint_expert") = py::none(),
        "Replays steps through `policy` as ExpertCache::acquire calls it (moe/policy_replay.h); returns the "
        "misses of each step (uint32 [n_steps]). layer int [n_steps]; offsets int [n_steps + 1] into "
        "experts; "
        "hints: (target layer, expert) pairs passed after each step, offsets [n_steps + 1].");
    m.def(
        "read_cache_prior",
        [](const std::string& path, int64_t n_layer, int64_t n_expert) {
            std::vector<float> v = read_cache_prior(path, n_layer, n_expert);
            py::array_t<float> out({static_cast<py::ssize_t>(n_layer), static_cast<py::ssize_t>(n_expert)});
            std::copy(v.begin(), v.end(), out.mutable_data());
            return out;
        },
        py::arg("path"), py::arg("n_layer"), py::arg("n_expert"),
        "The prior of a cache prior file (gguf/cache_prior_file.h) as float32 [n_layer, n_expert]");
}

}  // namespace sharpi::py_bindings
