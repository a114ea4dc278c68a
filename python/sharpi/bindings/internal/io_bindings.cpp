// sharpi._internal.ExpertReaderTest, uring_compiled() and reader_choice(): the expert readers
// (cpp/src/io/) seen from Python, for tests, benchmarks and `sharpi inspect`; the engine drives the
// readers from C++.
//
// ExpertReaderTest owns a 4 KiB-aligned arena and one reader whose buffers all lie in it. Two ways
// to use it, not mixed (read() refuses to run while asynchronous requests are outstanding):
// - read(requests): blocking; any number of (offset, length, priority) requests go through the
//   arena in a sliding window of equal slots; returns the requested bytes (or the byte count) and
//   raises IoError with the message of the first failed request, in request order, once every read
//   has finished.
// - submit/reap/data/cancel/promote/plug/unplug: one reader call each, for ordering tests; buffers
//   come from a bump allocator that rewinds once nothing is outstanding and every result was taken.
// ReadQueueTest drives the readers' shared request queue by hand, for deterministic tests of the
// scheduling rules. The GIL is released whenever the reader may block. Member order matters: the reader is
// destroyed before the arena, and its destructor waits for reads in flight.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "internal.h"
#include "io/cufile_probe.h"
#include "io/expert_reader.h"
#include "io/reader_common.h"
#include "sharpi/errors.h"

namespace py = pybind11;

namespace sharpi::py_bindings {

namespace {

// A request the reader must reject before any buffer arithmetic (zero length, range overflow).
bool malformed(uint64_t offset, uint64_t length) {
    return length == 0 || length > UINT64_MAX - ExpertReader::kAlignment ||
           offset > UINT64_MAX - ExpertReader::kAlignment - length;
}

ReadPriority parse_priority(const std::string& s) {
    if (s == "demand") return ReadPriority::demand;
    if (s == "prefetch") return ReadPriority::prefetch;
    throw InvalidArgument("priority must be 'demand' or 'prefetch', not '" + s + "'");
}

struct ArenaFree {
    void operator()(uint8_t* p) const { std::free(p); }
};

class ExpertReaderTest {
  public:
    ExpertReaderTest(const std::string& kind, const std::string& path, uint64_t arena_bytes, int queue_depth,
                     int pread_threads, uint64_t chunk_bytes, bool refuse_o_direct, bool register_arena) {
        if (arena_bytes == 0) throw InvalidArgument("arena_bytes must be > 0");
        arena_bytes_ = ExpertReader::align_up(arena_bytes);
        arena_.reset(static_cast<uint8_t*>(std::aligned_alloc(ExpertReader::kAlignment, arena_bytes_)));
        if (!arena_)
            throw InvalidArgument("cannot allocate an arena of " + std::to_string(arena_bytes_) + " bytes");
        std::memset(arena_.get(), 0, arena_bytes_);
        ReaderOptions options;
        options.queue_depth = queue_depth;
        options.pread_threads = pread_threads;
        options.chunk_bytes = chunk_bytes;
        options.refuse_o_direct = refuse_o_direct;
        // register_arena = false hides the arena from the reader: io_uring then does plain reads.
        reader_ = make_expert_reader(kind, path, register_arena ? arena_.get() : nullptr,
                                     register_arena ? arena_bytes_ : 0, options);
    }

    std::string name() const { return reader_->name(); }
    std::string describe() const { return reader_->describe(); }
    size_t outstanding() const { return reader_->outstanding(); }
    uint64_t inflight_bytes() const { return reader_->inflight_bytes(); }
    double busy_ms() const { return reader_->busy_ms(); }
    double bytes_per_ms() const { return reader_->bytes_per_ms(); }

    py::object read(const std::vector<std::tuple<uint64_t, uint64_t, std::string>>& requests, bool keep_bytes,
                    bool whole_span) {
        if (reader_->outstanding() != 0 || !records_.empty()) {
            throw InvalidArgument("read() while asynchronous requests are outstanding or not taken");
        }
        std::vector<ReadRequest> reqs(requests.size());
        uint64_t slot_bytes = ExpertReader::kAlignment;
        for (size_t i = 0; i < requests.size(); ++i) {
            reqs[i].tag = i;
            reqs[i].offset = std::get<0>(requests[i]);
            reqs[i].length = std::get<1>(requests[i]);
            reqs[i].priority = parse_priority(std::get<2>(requests[i]));
            if (!malformed(reqs[i].offset, reqs[i].length)) {
                slot_bytes = std::max(slot_bytes, ExpertReader::aligned_span(reqs[i].offset, reqs[i].length));
            }
        }
        const uint64_t n_slots = arena_bytes_ / slot_bytes;
        if (n_slots == 0) {
            throw InvalidArgument("arena of " + std::to_string(arena_bytes_) +
                                  " bytes cannot hold a read of " + std::to_string(slot_bytes) + " bytes");
        }
        std::vector<std::string> results(keep_bytes ? reqs.size() : 0);
        std::vector<std::string> errors(reqs.size());
        uint64_t total = 0;
        {
            py::gil_scoped_release release;
            std::vector<uint64_t> free_slots;
            for (uint64_t s = std::min<uint64_t>(n_slots, reqs.size()); s-- > 0;) free_slots.push_back(s);
            std::vector<uint64_t> slot_of(reqs.size());
            size_t next = 0;
            std::vector<ReadCompletion> done;
            try {
                while (next < reqs.size() || reader_->outstanding() > 0) {
                    while (next < reqs.size() && !free_slots.empty()) {
                        slot_of[next] = free_slots.back();
                        reqs[next].buffer = arena_.get() + slot_of[next] * slot_bytes;
                        reader_->submit(reqs[next]);  // throws InvalidArgument on a bad request
                        free_slots.pop_back();
                        ++next;
                    }
                    done.clear();
                    reader_->reap(done, true);
                    for (const ReadCompletion& c : done) {
                        const ReadRequest& r = reqs[c.tag];
                        if (!c.ok) {
                            errors[c.tag] = c.error;
                        } else if (keep_bytes) {
                            const uint8_t* p =
                                r.buffer + (whole_span ? 0 : r.offset % ExpertReader::kAlignment);
                            const uint64_t n =
                                whole_span ? ExpertReader::aligned_span(r.offset, r.length) : r.length;
                            results[c.tag].assign(reinterpret_cast<const char*>(p), n);
                        }
                        total += c.ok ? r.length : 0;
                        free_slots.push_back(slot_of[c.tag]);
                    }
                }
            } catch (...) {
                drain();  // never leave reads in flight into the arena behind an exception
                throw;
            }
        }
        for (const std::string& e : errors) {
            if (!e.empty()) throw IoError(e);
        }
        if (!keep_bytes) return py::int_(total);
        py::list out(results.size());
        for (size_t i = 0; i < results.size(); ++i) out[i] = py::bytes(results[i]);
        return std::move(out);
    }

    void submit(uint64_t tag, uint64_t offset, uint64_t length, const std::string& priority) {
        if (reader_->outstanding() == 0 && records_.empty()) bump_ = 0;
        ReadRequest r;
        r.tag = tag;
        r.offset = offset;
        r.length = length;
        r.priority = parse_priority(priority);
        if (malformed(offset, length)) {
            r.buffer = arena_.get();
            reader_->submit(r);                               // the reader rejects it with its own message
            throw InvalidArgument("malformed read request");  // not reached
        }
        const uint64_t span = ExpertReader::aligned_span(offset, length);
        if (span > arena_bytes_ - bump_) {
            throw InvalidArgument("arena full: " + std::to_string(arena_bytes_ - bump_) +
                                  " bytes left, read needs " + std::to_string(span));
        }
        if (records_.count(tag)) throw InvalidArgument("tag " + std::to_string(tag) + " is already in use");
        r.buffer = arena_.get() + bump_;
        reader_->submit(r);
        bump_ += span;
        records_[tag] = r;
    }

    std::vector<std::tuple<uint64_t, bool, std::string>> reap(bool wait) {
        std::vector<ReadCompletion> done;
        {
            py::gil_scoped_release release;
            reader_->reap(done, wait);
        }
        std::vector<std::tuple<uint64_t, bool, std::string>> out;
        for (const ReadCompletion& c : done) out.emplace_back(c.tag, c.ok, c.error);
        return out;
    }

    // The bytes of a completed asynchronous request (call after reap returned it); forgets the tag.
    py::bytes data(uint64_t tag, bool whole_span) {
        auto it = records_.find(tag);
        if (it == records_.end()) throw InvalidArgument("no request with tag " + std::to_string(tag));
        const ReadRequest r = it->second;
        records_.erase(it);
        const uint8_t* p = r.buffer + (whole_span ? 0 : r.offset % ExpertReader::kAlignment);
        const uint64_t n = whole_span ? ExpertReader::aligned_span(r.offset, r.length) : r.length;
        return py::bytes(reinterpret_cast<const char*>(p), n);
    }

    bool cancel(uint64_t tag) {
        const bool cancelled = reader_->cancel(tag);
        if (cancelled) records_.erase(tag);
        return cancelled;
    }
    void promote(uint64_t tag) { reader_->promote(tag); }
    void plug() { reader_->plug(); }
    void unplug() { reader_->unplug(); }

  private:
    void drain() {
        std::vector<ReadCompletion> done;
        while (reader_->outstanding() > 0) reader_->reap(done, true);
    }

    std::unique_ptr<uint8_t, ArenaFree> arena_;  // declared before reader_: destroyed after it
    uint64_t arena_bytes_ = 0;
    std::unique_ptr<ExpertReader> reader_;
    uint64_t bump_ = 0;
    std::map<uint64_t, ReadRequest> records_;  // asynchronous requests whose data() was not taken
};

// The readers' shared request queue (cpp/src/io/reader_common.h) driven by hand: the scheduling
// rules tested one chunk at a time with no threads and no timing. Each request gets its own buffer
// (never written: the queue only computes destinations) so every pointer stays inside an allocation.
class ReadQueueTest {
  public:
    ReadQueueTest(uint64_t chunk_bytes, int depth, const std::string& path) {
        ReaderOptions options;
        options.chunk_bytes = chunk_bytes;
        options.queue_depth = depth;
        const io::ResolvedOptions resolved = io::resolve_options(options);
        queue_ = std::make_unique<io::ReadQueue>(std::vector<std::string>{path}, resolved.chunk_bytes,
                                                 resolved.queue_depth, io::FaultInjection::from_env());
    }

    void add(uint64_t tag, uint64_t offset, uint64_t length, const std::string& priority) {
        ReadRequest r;
        r.tag = tag;
        r.offset = offset;
        r.length = length;
        r.priority = parse_priority(priority);
        // A malformed request gets a one-block buffer so that the queue reports what is wrong with it.
        const uint64_t bytes =
            malformed(offset, length) ? ExpertReader::kAlignment : ExpertReader::aligned_span(offset, length);
        std::unique_ptr<uint8_t, ArenaFree> buffer(
            static_cast<uint8_t*>(std::aligned_alloc(ExpertReader::kAlignment, bytes)));
        r.buffer = buffer.get();
        queue_->add(r);  // throws on a bad request, before the buffer is kept
        base_[tag] = ExpertReader::align_down(offset);
        bytes_[tag] = bytes;
        buffers_[tag] = std::move(buffer);
    }

    // (tag, begin, end) of the next chunk allowed to start, or None. Checks that the destination is
    // where the contract puts those bytes: buffer + (begin - align_down(offset)).
    py::object next_chunk() {
        io::Chunk c;
        if (!queue_->next_chunk(&c)) return py::none();
        const uint64_t tag = tag_of(c);
        if (c.dst != buffers_.at(tag).get() + (c.begin - base_.at(tag))) {
            throw std::logic_error("chunk destination is not at its offset in the buffer");
        }
        handed_out_[{tag, c.begin}] = c;
        return py::make_tuple(tag, c.begin, c.end);
    }

    // Reports a handed-out chunk: err = errno (0 = none); reached = where reading stopped.
    void finish_chunk(uint64_t tag, uint64_t begin, int err, uint64_t reached) {
        auto it = handed_out_.find({tag, begin});
        if (it == handed_out_.end()) throw InvalidArgument("no chunk in flight at that tag and offset");
        const io::Chunk c = it->second;
        handed_out_.erase(it);
        queue_->finish_chunk(c, err, reached);
    }

    std::vector<std::tuple<uint64_t, bool, std::string>> take() {
        std::vector<ReadCompletion> done;
        queue_->take_completions(done);
        std::vector<std::tuple<uint64_t, bool, std::string>> out;
        for (const ReadCompletion& c : done) out.emplace_back(c.tag, c.ok, c.error);
        return out;
    }

    bool cancel(uint64_t tag) { return queue_->cancel(tag); }
    void promote(uint64_t tag) { queue_->promote(tag); }
    void set_plugged(bool plugged) { queue_->set_plugged(plugged); }
    void drop_queued() { queue_->drop_queued(); }
    int in_flight() const { return queue_->in_flight(); }
    size_t outstanding() const { return queue_->outstanding(); }

  private:
    uint64_t tag_of(const io::Chunk& c) const {
        for (const auto& [tag, buffer] : buffers_) {
            if (c.dst >= buffer.get() && c.dst < buffer.get() + bytes_.at(tag)) return tag;
        }
        throw std::logic_error("chunk destination outside every request buffer");
    }

    std::unique_ptr<io::ReadQueue> queue_;
    std::map<uint64_t, std::unique_ptr<uint8_t, ArenaFree>> buffers_;  // kept after completion
    std::map<uint64_t, uint64_t> base_;   // align_down(offset) of the tag's request
    std::map<uint64_t, uint64_t> bytes_;  // its buffer's size
    std::map<std::pair<uint64_t, uint64_t>, io::Chunk> handed_out_;
};

// What "--reader auto" picks for `path` and why: tries to set up the io_uring reader exactly as
// make_expert_reader does (ring, O_DIRECT open, a probe read), without an arena, then drops it.
py::dict reader_choice(const std::string& path) {
    std::string why;
    bool works = false;
    {
        py::gil_scoped_release release;
        works = io::open_uring_reader({path}, nullptr, 0, ReaderOptions{}, &why) != nullptr;
    }
    py::dict d;
    d["reader"] = works ? "io_uring" : "pread";
    d["why"] = works ? "io_uring_setup and O_DIRECT reads through the ring work on this file"
                     : "io_uring unavailable: " + why;
    return d;
}

}  // namespace

void bind_io(py::module_& m) {
    m.def("uring_compiled", &uring_compiled,
          "True when this build has the io_uring reader (every Linux build: raw io_uring system calls)");
    m.def(
        "cufile_probe",
        []() {
            const CufileProbe p = probe_cufile();
            py::dict d;
            d["usable"] = p.usable;
            d["library"] = p.library;
            d["why"] = p.why;
            return d;
        },
        "{'usable', 'library', 'why'}: whether the cuFile reader could run here (a device and libcufile) and "
        "what is missing (io/cufile_probe.h)");
    m.def("reader_choice", &reader_choice, py::arg("path"),
          "{'reader': 'io_uring'|'pread', 'why': ...}: the reader --reader auto runs on this file, and why");

    py::class_<ExpertReaderTest>(
        m, "ExpertReaderTest",
        "An expert reader (kind 'auto', 'uring' or 'pread') over `path` with its own "
        "aligned arena; for tests and benchmarks")
        .def(py::init<const std::string&, const std::string&, uint64_t, int, int, uint64_t, bool, bool>(),
             py::arg("kind"), py::arg("path"), py::arg("arena_bytes") = uint64_t{64} << 20,
             py::arg("queue_depth") = 0, py::arg("pread_threads") = 0, py::arg("chunk_bytes") = 0,
             py::arg("refuse_o_direct") = false, py::arg("register_arena") = true)
        .def_property_readonly("name", &ExpertReaderTest::name)
        .def_property_readonly("inflight_bytes", &ExpertReaderTest::inflight_bytes,
                               "requested bytes submitted and neither reaped nor cancelled")
        .def_property_readonly("busy_ms", &ExpertReaderTest::busy_ms,
                               "time with at least one request outstanding, since construction")
        .def_property_readonly("bytes_per_ms", &ExpertReaderTest::bytes_per_ms,
                               "completed bytes / busy_ms (0 until a read completed)")
        .def_property_readonly("describe", &ExpertReaderTest::describe)
        .def_property_readonly("outstanding", &ExpertReaderTest::outstanding)
        .def("read", &ExpertReaderTest::read, py::arg("requests"), py::arg("keep_bytes") = true,
             py::arg("whole_span") = false,
             "Reads [(offset, length, 'demand'|'prefetch'), ...]; returns a list of bytes (the requested "
             "bytes, or the whole aligned span with whole_span=True), or the byte count with "
             "keep_bytes=False. Raises IoError for the first failed request.")
        .def("submit", &ExpertReaderTest::submit, py::arg("tag"), py::arg("offset"), py::arg("length"),
             py::arg("priority") = "demand")
        .def("reap", &ExpertReaderTest::reap, py::arg("wait") = true, "[(tag, ok, error), ...]")
        .def("data", &ExpertReaderTest::data, py::arg("tag"), py::arg("whole_span") = false)
        .def("cancel", &ExpertReaderTest::cancel, py::arg("tag"))
        .def("promote", &ExpertReaderTest::promote, py::arg("tag"))
        .def("plug", &ExpertReaderTest::plug)
        .def("unplug", &ExpertReaderTest::unplug);

    py::class_<ReadQueueTest>(m, "ReadQueueTest",
                              "The readers' request queue driven one chunk at a time (tests)")
        .def(py::init<uint64_t, int, const std::string&>(), py::arg("chunk_bytes"), py::arg("depth"),
             py::arg("path") = "model.gguf")
        .def("add", &ReadQueueTest::add, py::arg("tag"), py::arg("offset"), py::arg("length"),
             py::arg("priority") = "demand")
        .def("next_chunk", &ReadQueueTest::next_chunk, "(tag, begin, end) or None")
        .def("finish_chunk", &ReadQueueTest::finish_chunk, py::arg("tag"), py::arg("begin"), py::arg("err"),
             py::arg("reached"))
        .def("take", &ReadQueueTest::take, "[(tag, ok, error), ...]")
        .def("cancel", &ReadQueueTest::cancel, py::arg("tag"))
        .def("promote", &ReadQueueTest::promote, py::arg("tag"))
        .def("set_plugged", &ReadQueueTest::set_plugged, py::arg("plugged"))
        .def("drop_queued", &ReadQueueTest::drop_queued)
        .def_property_readonly("in_flight", &ReadQueueTest::in_flight)
        .def_property_readonly("outstanding", &ReadQueueTest::outstanding);
}

}  // namespace sharpi::py_bindings
