// Echo guesses: the experts a step's tokens will select, guessed from the sequence's own history
// before the step's first gate fires (docs/speculative.md "Draft experts prefetched").
//
// A token's routing at the first MoE layers depends mostly on the token itself, and a token that
// follows the same token as at an earlier position sees nearly the same context there. A prompt-
// lookup draft is by construction a span the sequence already holds, so its rows' earlier
// occurrences are the very positions it was copied from. The guess for a row is the recorded
// selections (every layer) of the latest earlier position holding the same token after the same
// previous token, else of the latest holding the same token; none when the token never occurred.
//
// Used twice, before a step the predictors cannot see yet (they need a layer's gate): the prefetcher
// stages the guessed experts of the first MoE layers at the step's start (Prefetcher::stage_guesses),
// and Session::predict_step_reads prices a draft of each length by the guessed experts the cache
// does not hold (the residency-aware draft length, python/sharpi/speculative.py).
#pragma once

#include <cstdint>
#include <vector>

#include "sharpi/types.h"

namespace sharpi {

// history: the sequence's kept tokens [n_hist] (-1 where unknown), selections: their experts
// [n_hist * row] (-1 where unknown), row = n_layer * top_k. step: the step's tokens [n_step], the
// first following history's last. Returns [n_step * row] guesses, -1 where a row has none (its
// token absent from history, or the matched position's selection unknown).
std::vector<int32_t> echo_guess(const token_t* history, const int32_t* selections, int64_t n_hist,
                                int64_t row, const token_t* step, int64_t n_step);

}  // namespace sharpi
