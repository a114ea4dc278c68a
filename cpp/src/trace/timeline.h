// Spans for a Chrome/Perfetto timeline (docs/design.md §7): compute per layer, stalls on expert IO, and
// expert reads from issue to completion. Disabled, every call is one predictable branch.
//
// Written only by the decode thread (the cache learns of read completions when it reaps them, so a
// read span ends when the decode thread observed it, never earlier than the read really finished),
// hence no locking. Times are microseconds since the Timeline was created.
#pragma once

#include <chrono>
#include <string>
#include <vector>

#include "sharpi/types.h"

namespace sharpi {

class Timeline {
  public:
    void set_enabled(bool on) { enabled_ = on; }
    bool enabled() const { return enabled_; }
    double now_us() const {
        return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - origin_).count();
    }
    void span(const char* track, std::string name, double start_us, double end_us) {
        if (enabled_) events_.push_back(TimelineEvent{track, std::move(name), start_us, end_us - start_us});
    }
    const std::vector<TimelineEvent>& events() const { return events_; }
    void clear() { events_.clear(); }

  private:
    bool enabled_ = false;
    std::chrono::steady_clock::time_point origin_ = std::chrono::steady_clock::now();
    std::vector<TimelineEvent> events_;
};

}  // namespace sharpi
