// Move-only owners of CUDA memory and synchronization objects. Each constructor either returns a
// usable object or throws (cuda_check.cuh); each destructor releases without throwing (a failure
// there means the context is already lost, and the error resurfaces at the next checked call).
//
// Synchronization: DeviceBuffer / PinnedBuffer free with cudaFree / cudaFreeHost, which wait for
// all work on the device; so a buffer may be dropped while kernels that read it are queued. Stream
// is a non-blocking stream (it does not synchronize with the legacy default stream). Event is
// created with cudaEventDisableTiming: it orders streams (record on the producer, wait on the
// consumer), it does not time them.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <string>
#include <utility>

#include "cuda_check.cuh"

namespace sharpi::cuda {

// n_bytes of device memory (cudaMalloc: 256-byte aligned). Contents uninitialized.
class DeviceBuffer {
  public:
    DeviceBuffer() = default;
    DeviceBuffer(size_t n_bytes, const std::string& what) : n_bytes_(n_bytes) {
        if (n_bytes > 0)
            cuda_check(cudaMalloc(&ptr_, n_bytes),
                       "cudaMalloc " + std::to_string(n_bytes) + " B for " + what);
    }
    ~DeviceBuffer() { release(); }
    DeviceBuffer(DeviceBuffer&& o) noexcept
        : ptr_(std::exchange(o.ptr_, nullptr)), n_bytes_(std::exchange(o.n_bytes_, 0)) {}
    DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
        if (this != &o) {
            release();
            ptr_ = std::exchange(o.ptr_, nullptr);
            n_bytes_ = std::exchange(o.n_bytes_, 0);
        }
        return *this;
    }
    DeviceBuffer(const DeviceBuffer&) = delete;
    DeviceBuffer& operator=(const DeviceBuffer&) = delete;

    void* data() const { return ptr_; }
    template <typename T>
    T* as() const {
        return static_cast<T*>(ptr_);
    }
    size_t size() const { return n_bytes_; }

  private:
    void release() {
        if (ptr_ != nullptr) cudaFree(ptr_);
        ptr_ = nullptr;
    }
    void* ptr_ = nullptr;
    size_t n_bytes_ = 0;
};

// n_bytes of page-locked host memory (cudaMallocHost): the source of asynchronous host->device
// copies that really overlap compute (a pageable source makes cudaMemcpyAsync synchronous).
class PinnedBuffer {
  public:
    PinnedBuffer() = default;
    PinnedBuffer(size_t n_bytes, const std::string& what) : n_bytes_(n_bytes) {
        if (n_bytes > 0) {
            cuda_check(cudaMallocHost(&ptr_, n_bytes),
                       "cudaMallocHost " + std::to_string(n_bytes) + " B for " + what);
        }
    }
    ~PinnedBuffer() { release(); }
    PinnedBuffer(PinnedBuffer&& o) noexcept
        : ptr_(std::exchange(o.ptr_, nullptr)), n_bytes_(std::exchange(o.n_bytes_, 0)) {}
    PinnedBuffer& operator=(PinnedBuffer&& o) noexcept {
        if (this != &o) {
            release();
            ptr_ = std::exchange(o.ptr_, nullptr);
            n_bytes_ = std::exchange(o.n_bytes_, 0);
        }
        return *this;
    }
    PinnedBuffer(const PinnedBuffer&) = delete;
    PinnedBuffer& operator=(const PinnedBuffer&) = delete;

    void* data() const { return ptr_; }
    template <typename T>
    T* as() const {
        return static_cast<T*>(ptr_);
    }
    size_t size() const { return n_bytes_; }

  private:
    void release() {
        if (ptr_ != nullptr) cudaFreeHost(ptr_);
        ptr_ = nullptr;
    }
    void* ptr_ = nullptr;
    size_t n_bytes_ = 0;
};

// A non-blocking stream. synchronize() waits for everything queued on it and reports (as a typed
// error) any asynchronous failure of that work.
class Stream {
  public:
    Stream() { cuda_check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate"); }
    ~Stream() {
        if (stream_ != nullptr) cudaStreamDestroy(stream_);
    }
    Stream(Stream&& o) noexcept : stream_(std::exchange(o.stream_, nullptr)) {}
    Stream& operator=(Stream&& o) noexcept {
        if (this != &o) {
            if (stream_ != nullptr) cudaStreamDestroy(stream_);
            stream_ = std::exchange(o.stream_, nullptr);
        }
        return *this;
    }
    Stream(const Stream&) = delete;
    Stream& operator=(const Stream&) = delete;

    cudaStream_t get() const { return stream_; }
    void synchronize(const std::string& what) const { cuda_check(cudaStreamSynchronize(stream_), what); }
    // Work queued on this stream after the call waits for `event` (recorded on another stream).
    void wait(cudaEvent_t event) const {
        cuda_check(cudaStreamWaitEvent(stream_, event, 0), "cudaStreamWaitEvent");
    }

  private:
    cudaStream_t stream_ = nullptr;
};

// An ordering point between streams; timing = true also lets elapsed_us measure between two of them
// (the timeline's device times; timing events cost more to record, so only the timeline asks).
class Event {
  public:
    explicit Event(bool timing = false) {
        cuda_check(cudaEventCreateWithFlags(&event_, timing ? cudaEventDefault : cudaEventDisableTiming),
                   "cudaEventCreate");
    }
    ~Event() {
        if (event_ != nullptr) cudaEventDestroy(event_);
    }
    Event(Event&& o) noexcept : event_(std::exchange(o.event_, nullptr)) {}
    Event& operator=(Event&& o) noexcept {
        if (this != &o) {
            if (event_ != nullptr) cudaEventDestroy(event_);
            event_ = std::exchange(o.event_, nullptr);
        }
        return *this;
    }
    Event(const Event&) = delete;
    Event& operator=(const Event&) = delete;

    cudaEvent_t get() const { return event_; }
    // Marks the point of `stream` after everything queued on it so far.
    void record(const Stream& stream) const { record(stream.get()); }
    void record(cudaStream_t stream) const { cuda_check(cudaEventRecord(event_, stream), "cudaEventRecord"); }
    void synchronize() const { cuda_check(cudaEventSynchronize(event_), "cudaEventSynchronize"); }

  private:
    cudaEvent_t event_ = nullptr;
};

// Device microseconds from `from` to `to`, two completed timing events (on any streams of the device).
inline double elapsed_us(const Event& from, const Event& to) {
    float ms = 0.0f;
    cuda_check(cudaEventElapsedTime(&ms, from.get(), to.get()), "cudaEventElapsedTime");
    return 1e3 * static_cast<double>(ms);
}

// Device times on the host's timeline (trace/timeline.h): a timing event recorded on an idle stream
// and the host time at which it was seen complete; a later timing event's host time is that plus the
// device time between them (off by the host's wake-up latency, microseconds, and never later than
// the host observed the event).
struct DeviceClock {
    Event ref{true};
    double ref_us = 0.0;
    double host_us(const Event& e) const { return ref_us + elapsed_us(ref, e); }
};

// Host -> device / device -> host copies on a stream, checked.
inline void copy_to_device(void* dst, const void* src, size_t n_bytes, const Stream& stream,
                           const std::string& what) {
    cuda_check(cudaMemcpyAsync(dst, src, n_bytes, cudaMemcpyHostToDevice, stream.get()),
               "copy to device: " + what);
}
inline void copy_to_host(void* dst, const void* src, size_t n_bytes, const Stream& stream,
                         const std::string& what) {
    cuda_check(cudaMemcpyAsync(dst, src, n_bytes, cudaMemcpyDeviceToHost, stream.get()),
               "copy to host: " + what);
}

}  // namespace sharpi::cuda
