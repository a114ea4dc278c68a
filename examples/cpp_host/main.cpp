// sharpi_host MODEL.gguf [PROMPT_TOKENS] [N]: decode comma-separated token ids (default "1") and
// greedily generate N tokens (default 16) with the public C++ API only. Prints the generated ids
// and the top logit of each step. Exit status 1 with the error message on any sharpi::Error.
#include <sharpi/session.h>

#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

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
        sharpi::Session session(argv[1], options);
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
    } catch (const sharpi::Error& e) {
        std::fprintf(stderr, "sharpi_host: %s\n", e.what());
        return 1;
    }
    return 0;
}
