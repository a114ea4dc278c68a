#include "predict/echo_guess.h"

#include <algorithm>

namespace sharpi {

std::vector<int32_t> echo_guess(const token_t* history, const int32_t* selections, int64_t n_hist,
                                int64_t row, const token_t* step, int64_t n_step) {
    std::vector<int32_t> out(static_cast<size_t>(n_step * row), -1);
    for (int64_t r = 0; r < n_step; ++r) {
        const token_t token = step[r];
        const token_t before = r > 0 ? step[r - 1] : (n_hist > 0 ? history[n_hist - 1] : -1);
        // Latest position with the same (previous, token) pair, else the latest with the token.
        int64_t pair = -1, alone = -1;
        for (int64_t p = n_hist - 1; p >= 0 && pair < 0; --p) {
            if (history[p] != token) continue;
            if (alone < 0) alone = p;
            if (p > 0 && before >= 0 && history[p - 1] == before) pair = p;
        }
        const int64_t at = pair >= 0 ? pair : alone;
        if (at < 0) continue;
        std::copy_n(selections + at * row, row, out.begin() + r * row);
    }
    return out;
}

}  // namespace sharpi
