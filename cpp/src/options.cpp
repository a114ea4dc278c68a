#include "sharpi/options.h"

#include <cctype>
#include <cmath>
#include <string>

#include "sharpi/errors.h"

namespace sharpi {

namespace {

// "NAME:FILE" -> name = NAME, file = FILE; `what` names the pair in the error ("predictor").
void split_name_and_file(std::string& name, std::string& file, const std::string& what) {
    const size_t colon = name.find(':');
    if (colon == std::string::npos) return;
    const std::string file_part = name.substr(colon + 1);
    if (!file.empty() && file != file_part) {
        throw InvalidArgument(what + " file given twice: '" + file_part + "' and '" + file + "'");
    }
    name.resize(colon);
    file = file_part;
}

}  // namespace

SessionOptions resolve_session_options(const SessionOptions& options) {
    SessionOptions o = options;
    split_name_and_file(o.predictor, o.predictor_file, "predictor");
    split_name_and_file(o.cache_policy, o.cache_policy_file, "cache policy");
    return o;
}

uint64_t parse_budget(const std::string& text) {
    const size_t first = text.find_first_not_of(" \t\n\r\f\v");
    const size_t last = text.find_last_not_of(" \t\n\r\f\v");
    std::string word = first == std::string::npos ? "" : text.substr(first, last - first + 1);
    for (char& c : word) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    return word == "auto" ? SessionOptions::kBudgetAuto : parse_byte_size(text);
}

uint64_t parse_byte_size(const std::string& text) {
    size_t i = 0;
    while (i < text.size() && (std::isdigit(static_cast<unsigned char>(text[i])) || text[i] == '.')) ++i;
    const std::string number = text.substr(0, i);
    std::string unit = text.substr(i);
    while (!unit.empty() && unit.front() == ' ') unit.erase(unit.begin());
    auto bad = [&]() {
        return InvalidArgument("invalid byte size '" + text + "' (examples: 6GiB, 512MiB, 1.5GB, 4096)");
    };
    if (number.empty() || number.find('.') != number.rfind('.')) throw bad();
    const double value = std::stod(number);
    double scale = 0;
    std::string u;
    for (char c : unit) u += static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    if (u.empty() || u == "B")
        scale = 1;
    else if (u == "K" || u == "KIB")
        scale = 1024.0;
    else if (u == "M" || u == "MIB")
        scale = 1024.0 * 1024;
    else if (u == "G" || u == "GIB")
        scale = 1024.0 * 1024 * 1024;
    else if (u == "T" || u == "TIB")
        scale = 1024.0 * 1024 * 1024 * 1024;
    else if (u == "KB")
        scale = 1e3;
    else if (u == "MB")
        scale = 1e6;
    else if (u == "GB")
        scale = 1e9;
    else if (u == "TB")
        scale = 1e12;
    else
        throw bad();
    const double bytes = value * scale;
    if (!(bytes >= 1.0) || bytes > 1.8e19) throw bad();
    return static_cast<uint64_t>(std::llround(bytes));
}

}  // namespace sharpi
