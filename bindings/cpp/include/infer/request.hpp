// libinfer C++ binding: building a request.
//
// Request owns one infer_request until it is handed to Server::infer / Server::enqueue
// (which always take it, also when they throw). Borrowed inputs (host or device memory)
// keep their release functor in a heap holder that the library's release callback
// deletes; it never lets an exception out into the library.
#ifndef INFER_CPP_REQUEST_HPP
#define INFER_CPP_REQUEST_HPP

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "infer.h"
#include "infer/error.hpp"
#include "infer/tensor.hpp"

namespace infer {

class Server;

namespace detail {

/// The functor a borrowed input runs when the library is done with its buffer.
struct ReleaseHolder {
    virtual ~ReleaseHolder() = default;
    virtual void run() noexcept = 0;
};

template <class F>
struct ReleaseFunctor final : ReleaseHolder {
    explicit ReleaseFunctor(F &&f) : fn(std::move(f)) {}
    void run() noexcept override {
        try {
            fn();
        } catch (...) {
            // Nothing can be reported from a release callback; it must not unwind into C.
        }
    }
    F fn;
};

extern "C" {
/// The library's release callback for borrowed inputs: runs, then deletes, the holder.
static inline void infer_cpp_release_trampoline(void *user_data) {
    auto *holder = static_cast<ReleaseHolder *>(user_data);
    holder->run();
    delete holder;
}
}

} // namespace detail

/// Sequence flags of a request.
enum RequestFlags : uint32_t {
    SequenceStart = INFER_REQUEST_FLAG_SEQUENCE_START,
    SequenceEnd = INFER_REQUEST_FLAG_SEQUENCE_END,
};

/// An inference request for one model, built with chained setters and handed to
/// Server::infer or Server::enqueue with std::move. Move-only; not thread-safe (build it
/// on one thread). Every setter throws infer::Error when the library refuses the value
/// (unknown input, wrong datatype, shape or byte size, ...).
///
/// Each setter has an lvalue and an rvalue form, so both styles work:
///
///     infer::Request req = server.request("add_sub");
///     req.input<float>("INPUT0", {1, 4}, a).input<float>("INPUT1", {1, 4}, b);
///     server.infer(std::move(req));
///     server.infer(server.request("add_sub").input<float>(...).input<float>(...));
class Request {
public:
    /// A request for `version` (-1 = latest) of a loaded model of `server`.
    Request(const Server &server, const std::string &model, int64_t version = -1);
    /// The same from a C server handle (borrowed: the server must outlive the call).
    Request(infer_server *server, const std::string &model, int64_t version = -1) {
        infer_request *r = nullptr;
        detail::check(infer_request_new(server, model.c_str(), version, &r));
        handle_.reset(r);
    }
    Request(Request &&) noexcept = default;
    Request &operator=(Request &&) noexcept = default;
    Request(const Request &) = delete;
    Request &operator=(const Request &) = delete;

    /// False once moved from or sent.
    explicit operator bool() const noexcept { return handle_ != nullptr; }

    // ---- inputs, copied at once ----

    /// Adds an input, copying `byte_size` bytes of `data`.
    Request &input_raw(const std::string &name, DataType dt, const Shape &shape, const void *data,
                       std::size_t byte_size) & {
        detail::check(infer_request_add_input(handle(), name.c_str(),
                                              static_cast<infer_datatype>(dt), shape.data(),
                                              shape.size(), data, byte_size));
        return *this;
    }
    Request &&input_raw(const std::string &name, DataType dt, const Shape &shape,
                        const void *data, std::size_t byte_size) && {
        return std::move(input_raw(name, dt, shape, data, byte_size));
    }

    /// Adds an input of `count` elements of T, copied; the datatype comes from T.
    template <class T>
    Request &input(const std::string &name, const Shape &shape, const T *data,
                   std::size_t count) & {
        return input_raw(name, datatype_of_v<T>, shape, data, count * sizeof(T));
    }
    template <class T>
    Request &&input(const std::string &name, const Shape &shape, const T *data,
                    std::size_t count) && {
        return std::move(input<T>(name, shape, data, count));
    }

    /// Adds an input holding the elements of `data`, copied.
    template <class T>
    Request &input(const std::string &name, const Shape &shape, const std::vector<T> &data) & {
        if constexpr (std::is_same_v<T, bool>) {
            // std::vector<bool> packs bits; BOOL tensors hold one byte per element.
            const std::vector<uint8_t> bytes(data.begin(), data.end());
            return input_raw(name, DataType::Bool, shape, bytes.data(), bytes.size());
        } else {
            return input_raw(name, datatype_of_v<T>, shape, data.data(), data.size() * sizeof(T));
        }
    }
    template <class T>
    Request &&input(const std::string &name, const Shape &shape, const std::vector<T> &data) && {
        return std::move(input<T>(name, shape, data));
    }

    /// Adds an input holding the elements of a C array, copied:
    /// `req.input<float>("INPUT0", {1, 4}, {1, 2, 3, 4})`.
    template <class T, std::size_t N>
    Request &input(const std::string &name, const Shape &shape, const T (&data)[N]) & {
        return input_raw(name, datatype_of_v<T>, shape, data, N * sizeof(T));
    }
    template <class T, std::size_t N>
    Request &&input(const std::string &name, const Shape &shape, const T (&data)[N]) && {
        return std::move(input<T, N>(name, shape, data));
    }

    /// Adds a BYTES input, one element per string (encoded with infer::encode_bytes).
    template <class Strings>
    Request &input_strings(const std::string &name, const Shape &shape, const Strings &strings) & {
        const std::vector<char> bytes = encode_bytes(strings);
        return input_raw(name, DataType::Bytes, shape, bytes.data(), bytes.size());
    }
    template <class Strings>
    Request &&input_strings(const std::string &name, const Shape &shape,
                            const Strings &strings) && {
        return std::move(input_strings(name, shape, strings));
    }

    // ---- inputs, borrowed without a copy ----

    /// Adds an input the library reads in place until it calls `on_release()` (once,
    /// from any thread: after the request's responses, or when the request is destroyed
    /// unsent). If this call throws, the buffer was not taken and `on_release` is
    /// destroyed without being called. Host memory only (see input_device_raw).
    template <class F>
    Request &input_borrowed_raw(const std::string &name, DataType dt, const Shape &shape,
                                const void *data, std::size_t byte_size, F &&on_release) & {
        return borrow(name, dt, shape, data, byte_size, MemoryType::Cpu, 0,
                      std::forward<F>(on_release));
    }
    template <class F>
    Request &&input_borrowed_raw(const std::string &name, DataType dt, const Shape &shape,
                                 const void *data, std::size_t byte_size, F &&on_release) && {
        return std::move(
            input_borrowed_raw(name, dt, shape, data, byte_size, std::forward<F>(on_release)));
    }

    /// Adds an input in the device memory of GPU `device_id`: `device_ptr` (a CUdeviceptr
    /// as a pointer, never read on the host by this binding) must lie in one allocation of
    /// that device holding all `byte_size` bytes, and the work that wrote it must be
    /// complete. The library reads it (on the GPU, or into a host copy made at enqueue
    /// for models not on GPUs) until it calls `on_release()`, once, from any thread;
    /// keep the memory unchanged until then. Throws UNAVAILABLE without a usable GPU
    /// (also when the server's GPU use is Off), INVALID_ARGUMENT for a device that does
    /// not exist, a range outside one allocation, or a BYTES input; when it throws, the
    /// memory was not taken and `on_release` is destroyed without being called.
    template <class F>
    Request &input_device_raw(const std::string &name, DataType dt, const Shape &shape,
                              const void *device_ptr, std::size_t byte_size, int64_t device_id,
                              F &&on_release) & {
        return borrow(name, dt, shape, device_ptr, byte_size, MemoryType::Gpu, device_id,
                      std::forward<F>(on_release));
    }
    template <class F>
    Request &&input_device_raw(const std::string &name, DataType dt, const Shape &shape,
                               const void *device_ptr, std::size_t byte_size,
                               int64_t device_id, F &&on_release) && {
        return std::move(input_device_raw(name, dt, shape, device_ptr, byte_size, device_id,
                                          std::forward<F>(on_release)));
    }

    /// Borrows `count` elements of T at `data`; `on_release()` says when they may go.
    template <class T, class F>
    Request &input_borrowed(const std::string &name, const Shape &shape, const T *data,
                            std::size_t count, F &&on_release) & {
        return input_borrowed_raw(name, datatype_of_v<T>, shape, data, count * sizeof(T),
                                  std::forward<F>(on_release));
    }
    template <class T, class F>
    Request &&input_borrowed(const std::string &name, const Shape &shape, const T *data,
                             std::size_t count, F &&on_release) && {
        return std::move(input_borrowed<T>(name, shape, data, count, std::forward<F>(on_release)));
    }

    /// Borrows a shared buffer: the request keeps a reference until the library releases
    /// the input, so the caller need not track its lifetime.
    template <class T>
    Request &input_borrowed(const std::string &name, const Shape &shape,
                            std::shared_ptr<const std::vector<T>> data) & {
        static_assert(!std::is_same_v<T, bool>, "std::vector<bool> cannot be borrowed");
        detail::require_handle(data.get(), "borrowed input buffer");
        const T *p = data->data();
        const std::size_t n = data->size();
        return input_borrowed_raw(name, datatype_of_v<T>, shape, p, n * sizeof(T),
                                  [keep = std::move(data)]() mutable { keep.reset(); });
    }
    template <class T>
    Request &&input_borrowed(const std::string &name, const Shape &shape,
                             std::shared_ptr<const std::vector<T>> data) && {
        return std::move(input_borrowed<T>(name, shape, std::move(data)));
    }

    // ---- what to compute and how ----

    /// Where the outputs should live (default: MemoryType::Cpu). With MemoryType::Gpu,
    /// outputs that a GPU instance produces in device memory stay on that instance's
    /// device, and every other output but BYTES (models on the CPU included) is copied
    /// to `device_id` before the response is delivered: read them with
    /// Response::device_output. BYTES outputs stay in host memory, so check
    /// Response::output_memory. CpuPinned is served as Cpu. Gpu
    /// throws UNAVAILABLE without a usable GPU (also when the server's GPU use is Off)
    /// and INVALID_ARGUMENT for a device id that does not exist.
    Request &output_memory(MemoryType mem, int64_t device_id = 0) & {
        detail::check(infer_request_set_output_memory(
            handle(), static_cast<infer_memory_type>(mem), device_id));
        return *this;
    }
    Request &&output_memory(MemoryType mem, int64_t device_id = 0) && {
        return std::move(output_memory(mem, device_id));
    }

    /// Asks for one output (call again for more); with none requested, all are returned.
    Request &requested_output(const std::string &name) & {
        detail::check(infer_request_add_requested_output(handle(), name.c_str()));
        return *this;
    }
    Request &&requested_output(const std::string &name) && {
        return std::move(requested_output(name));
    }

    /// A numeric correlation ID (sequence models; never 0).
    Request &correlation_id(uint64_t id) & {
        detail::check(infer_request_set_correlation_id(handle(), id));
        return *this;
    }
    Request &&correlation_id(uint64_t id) && { return std::move(correlation_id(id)); }

    /// A string correlation ID of at most INFER_MAX_CORRELATION_ID_BYTES bytes.
    Request &correlation_id(const std::string &id) & {
        detail::check(infer_request_set_correlation_id_str(handle(), id.c_str()));
        return *this;
    }
    Request &&correlation_id(const std::string &id) && { return std::move(correlation_id(id)); }

    /// Replaces all flags (RequestFlags bits).
    Request &flags(uint32_t f) & {
        detail::check(infer_request_set_flags(handle(), f));
        flags_ = f;
        return *this;
    }
    Request &&flags(uint32_t f) && { return std::move(flags(f)); }

    /// Sets or clears INFER_REQUEST_FLAG_SEQUENCE_START, keeping the other flags.
    Request &sequence_start(bool on = true) & {
        return flags(on ? (flags_ | SequenceStart) : (flags_ & ~static_cast<uint32_t>(SequenceStart)));
    }
    Request &&sequence_start(bool on = true) && { return std::move(sequence_start(on)); }

    /// Sets or clears INFER_REQUEST_FLAG_SEQUENCE_END, keeping the other flags.
    Request &sequence_end(bool on = true) & {
        return flags(on ? (flags_ | SequenceEnd) : (flags_ & ~static_cast<uint32_t>(SequenceEnd)));
    }
    Request &&sequence_end(bool on = true) && { return std::move(sequence_end(on)); }

    /// Priority level: 0 = the model's default, 1 = highest (checked at enqueue).
    Request &priority(uint32_t level) & {
        detail::check(infer_request_set_priority(handle(), level));
        return *this;
    }
    Request &&priority(uint32_t level) && { return std::move(priority(level)); }

    /// Queue timeout (0 = none), rounded down to microseconds.
    template <class Rep, class Period>
    Request &timeout(std::chrono::duration<Rep, Period> t) & {
        const auto us = std::chrono::duration_cast<std::chrono::microseconds>(t).count();
        if (us < 0) {
            throw Error(INFER_STATUS_INVALID_ARGUMENT, "a request timeout must not be negative");
        }
        detail::check(infer_request_set_timeout_us(handle(), static_cast<uint64_t>(us)));
        return *this;
    }
    template <class Rep, class Period>
    Request &&timeout(std::chrono::duration<Rep, Period> t) && {
        return std::move(timeout(t));
    }

    /// A request parameter: bool, any integer (as int64), float/double, or a string.
    template <class V>
    Request &parameter(const std::string &key, const V &value) & {
        using D = std::decay_t<V>;
        if constexpr (std::is_same_v<D, bool>) {
            detail::check(infer_request_set_parameter_bool(handle(), key.c_str(), value));
        } else if constexpr (std::is_integral_v<D>) {
            if constexpr (std::is_unsigned_v<D> && sizeof(D) >= sizeof(int64_t)) {
                if (value > static_cast<D>(INT64_MAX)) {
                    throw Error(INFER_STATUS_INVALID_ARGUMENT,
                                "parameter '" + key + "': " + std::to_string(value) +
                                    " does not fit an int64");
                }
            }
            detail::check(infer_request_set_parameter_int(handle(), key.c_str(),
                                                          static_cast<int64_t>(value)));
        } else if constexpr (std::is_floating_point_v<D>) {
            detail::check(infer_request_set_parameter_double(handle(), key.c_str(),
                                                             static_cast<double>(value)));
        } else {
            static_assert(std::is_convertible_v<const V &, std::string_view>,
                          "a parameter is a bool, an integer, a floating-point number or a string");
            const std::string s{std::string_view(value)};
            detail::check(infer_request_set_parameter_string(handle(), key.c_str(), s.c_str()));
        }
        return *this;
    }
    template <class V>
    Request &&parameter(const std::string &key, const V &value) && {
        return std::move(parameter(key, value));
    }

    /// The C handle, still owned by this Request.
    infer_request *native_handle() const noexcept { return handle_.get(); }
    /// Gives up ownership: the caller enqueues or frees the result.
    infer_request *release() noexcept { return handle_.release(); }

private:
    /// infer_request_add_input_borrowed with `on_release` in a heap holder that the
    /// library's release callback runs and deletes (here, if the call fails).
    template <class F>
    Request &borrow(const std::string &name, DataType dt, const Shape &shape, const void *data,
                    std::size_t byte_size, MemoryType mem, int64_t device_id, F &&on_release) {
        static_assert(std::is_invocable_v<std::decay_t<F> &>, "on_release must be callable as f()");
        auto holder = std::make_unique<detail::ReleaseFunctor<std::decay_t<F>>>(
            std::decay_t<F>(std::forward<F>(on_release)));
        detail::check(infer_request_add_input_borrowed(
            handle(), name.c_str(), static_cast<infer_datatype>(dt), shape.data(), shape.size(),
            data, byte_size, static_cast<infer_memory_type>(mem), device_id,
            &detail::infer_cpp_release_trampoline,
            static_cast<detail::ReleaseHolder *>(holder.get())));
        holder.release(); // the library owns it now and hands it to the trampoline
        return *this;
    }

    infer_request *handle() const {
        detail::require_handle(handle_.get(), "infer::Request");
        return handle_.get();
    }

    struct Free {
        void operator()(infer_request *r) const noexcept { infer_request_free(r); }
    };
    std::unique_ptr<infer_request, Free> handle_;
    uint32_t flags_ = 0;
};

} // namespace infer

#endif // INFER_CPP_REQUEST_HPP
