// sharpi_host MODEL.gguf [PROMPT_TOKENS] [N] [RAM_BUDGET]: decode comma-separated token ids
// (default "1") and greedily generate N tokens (default 16) with the public C++ API only. Prints
// the generated ids and the top logit of each step. With RAM_BUDGET (e.g. 64MiB) experts stream from
// the file and a host-written predictor (below) prefetches them. Then the same prompt twice at once,
// on two sequences decoded in one step each (Session::decode_batch), which must generate the same ids.
// Exit status 1 with the error message on any sharpi::Error.
#include <sharpi/predictor.h>
#include <sharpi/session.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

// A C++ predictor plug-in: for the next layer, guess the experts this layer selected, best first.
class SameAsThisLayer final : public sharpi::Predictor {
  public:
    const char* name() const override { return "same_as_this_layer"; }
    void observe(const sharpi::PredictorInput& in, std::vector<sharpi::PrefetchHint>& hints) override {
        ++calls;
        if (in.layer + 1 >= in.n_layer) return;
        const int32_t* mine = in.history + in.layer * in.top_k;
        for (int j = 0; j < in.top_k; ++j)
            hints.push_back({in.layer + 1, mine[j], static_cast<float>(in.top_k - j)});
    }
    long calls = 0;
};

int main(int argc, char** argv) {
    if (argc < 2) {
        std::fprintf(stderr, "usage: %s MODEL.gguf [TOKENS e.g. 1,2,3] [N]\n", argv[0]);
        return 2;
    }
    std::vector<sharpi::token_t> prompt;
    std::stringstream ss(argc > 2 ? argv[2] : "1");
    for (std::string item; std::getline(ss, item, ',');) prompt.push_back(std::stoi(item));
    const int n_generate = argc > 3 ? std::atoi(argv[3]) : 16;

    try {
        sharpi::SessionOptions options;
        options.n_threads = 2;
        options.n_seq = 2;
        auto predictor = std::make_shared<SameAsThisLayer>();
        if (argc > 4) {
            options.ram_budget = sharpi::parse_byte_size(argv[4]);
            options.predictor = "custom";
        }
        sharpi::Session session(argv[1], options);
        if (argc > 4) session.set_predictor(predictor);
        const sharpi::ModelInfo& info = session.info();
        std::printf("model: %s, %lld layers, %lld experts (top-%lld), vocab %lld\n", info.arch.c_str(),
                    static_cast<long long>(info.n_layer), static_cast<long long>(info.n_expert),
                    static_cast<long long>(info.n_expert_used), static_cast<long long>(info.n_vocab));

        sharpi::SamplingParams greedy;
        greedy.temperature = 0.0f;
        sharpi::Sampler sampler(greedy);
        std::vector<float> logits = session.decode(prompt);
        std::vector<sharpi::token_t> history = prompt, generated;
        for (int i = 0; i < n_generate; ++i) {
            const sharpi::token_t next = sampler.sample(logits.data(), info.n_vocab, history);
            std::printf("step %d: token %d logit %.6f\n", i, next, logits[static_cast<size_t>(next)]);
            generated.push_back(next);
            history.push_back(next);
            logits = session.decode({next});
        }
        std::printf("generated:");
        for (sharpi::token_t t : generated) std::printf(" %d", t);
        std::printf("\n");
        if (argc > 4) {
            uint64_t issued = 0, used = 0;
            for (const sharpi::LayerExpertStats& l : session.expert_stats().layers) {
                issued += l.prefetch_issued;
                used += l.prefetch_used;
            }
            std::printf("predictor calls %ld, prefetch issued %llu, used %llu\n", predictor->calls,
                        static_cast<unsigned long long>(issued), static_cast<unsigned long long>(used));
        }

        // Two sequences in one step: each gets the logits it gets alone, so the same greedy ids.
        session.reset();
        const int32_t second = session.add_sequence();
        std::vector<std::vector<float>> step =
            session.decode_batch({{0, prompt, false}, {second, prompt, false}});
        std::vector<std::vector<sharpi::token_t>> batched(2), histories(2, prompt);
        for (int i = 0; i < n_generate; ++i) {
            std::vector<sharpi::SequenceTokens> next(2);
            for (size_t b = 0; b < 2; ++b) {
                const sharpi::token_t t = sampler.sample(step[b].data(), info.n_vocab, histories[b]);
                batched[b].push_back(t);
                histories[b].push_back(t);
                next[b] = {b == 0 ? 0 : second, {t}, false};
            }
            step = session.decode_batch(next);
        }
        for (size_t b = 0; b < 2; ++b) {
            std::printf("batched sequence %zu:", b);
            for (sharpi::token_t t : batched[b]) std::printf(" %d", t);
            std::printf("\n");
        }
    } catch (const sharpi::Error& e) {
        std::fprintf(stderr, "sharpi_host: %s\n", e.what());
        return 1;
    }
    return 0;
}
