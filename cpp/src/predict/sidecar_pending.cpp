// TEMPORARY until the cpppred branch lands (it defines these in cooc/learned/trajectory.cpp).
#include "predict/predictor.h"
#include "sharpi/errors.h"
namespace sharpi {
std::unique_ptr<Predictor> load_cooc_predictor(const std::string&, const Model&, int) { throw UnsupportedError("cooc: pending"); }
std::unique_ptr<Predictor> load_learned_predictor(const std::string&, const Model&, int) { throw UnsupportedError("learned: pending"); }
std::unique_ptr<Predictor> load_trajectory_predictor(const std::string&, const Model&, int) { throw UnsupportedError("trajectory: pending"); }
}
