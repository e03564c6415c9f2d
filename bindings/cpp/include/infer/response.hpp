// libinfer C++ binding: the response to a request.
//
// Response owns one infer_response and frees it on destruction (on any thread, as the C
// API allows). Reading outputs of a failed response throws that response's error. The
// host accessors (output, output_at, output<T>) refuse outputs in GPU memory instead of
// handing out a device address as host memory; device_output gives those.
#ifndef INFER_CPP_RESPONSE_HPP
#define INFER_CPP_RESPONSE_HPP

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "infer.h"
#include "infer/error.hpp"
#include "infer/tensor.hpp"

namespace infer {

/// One response of a request: its status and, on success, its output tensors. Move-only;
/// a Tensor, TensorView or DeviceTensor read from it is valid until the Response is
/// destroyed (moving the Response keeps them valid). The accessors may be called from any thread, but one
/// Response is not meant to be destroyed while another thread reads it.
class Response {
public:
    /// Takes ownership of `r` (may be NULL: an empty Response).
    explicit Response(infer_response *r) noexcept : handle_(r) {}
    Response(Response &&) noexcept = default;
    Response &operator=(Response &&) noexcept = default;
    Response(const Response &) = delete;
    Response &operator=(const Response &) = delete;

    /// False for a moved-from Response.
    explicit operator bool() const noexcept { return handle_ != nullptr; }

    /// OK, or the status the request ended with.
    Status status() const noexcept { return infer_response_status(handle_.get()); }
    bool ok() const noexcept { return status() == INFER_STATUS_OK; }
    /// The error message; "" when the status is OK.
    std::string error_message() const {
        const char *m = infer_response_error_message(handle_.get());
        return m != nullptr ? std::string(m) : std::string();
    }
    /// Throws infer::Error with this response's status and message unless it is OK.
    const Response &throw_if_error() const {
        if (!ok()) {
            throw Error(status(), handle_ ? error_message() : std::string("empty response"));
        }
        return *this;
    }

    /// The id infer_server_enqueue gave the request.
    uint64_t request_id() const noexcept { return infer_response_request_id(handle_.get()); }
    std::string model_name() const { return infer_response_model_name(handle_.get()); }
    int64_t model_version() const noexcept { return infer_response_model_version(handle_.get()); }
    /// The numeric correlation ID (0 if none or a string ID).
    uint64_t correlation_id() const noexcept {
        return infer_response_correlation_id(handle_.get());
    }

    /// Number of output tensors (0 for a failed response).
    std::size_t output_count() const noexcept {
        return infer_response_output_count(handle_.get());
    }

    /// Output `index` (0-based), in host memory; throws the response's error if it
    /// failed, and INVALID_ARGUMENT, naming the output and the GPU, if the output is in
    /// GPU memory (read those with device_output_at).
    Tensor output_at(std::size_t index) const {
        throw_if_error();
        const Raw o = read(index);
        if (!o.where.on_host()) {
            throw Error(INFER_STATUS_INVALID_ARGUMENT,
                        "output '" + o.name + "' is in the memory of GPU " +
                            std::to_string(o.where.device_id) +
                            ", not in host memory: read it with Response::device_output, or "
                            "ask for host outputs with Request::output_memory(MemoryType::Cpu)");
        }
        return Tensor(o.name, o.dt, Shape(o.shape, o.shape + o.ndim), o.data, o.bytes);
    }

    /// The output called `name`, in host memory: NOT_FOUND if the response has none of
    /// that name; the response's own error if it failed; INVALID_ARGUMENT if the output
    /// is in GPU memory (see device_output).
    Tensor output(const std::string &name) const { return output_at(output_index(name)); }

    /// Where output `index` lives: {MemoryType::Cpu, 0} in host memory, or
    /// {MemoryType::Gpu, device id}. INVALID_ARGUMENT past the end; the response's error
    /// if it failed.
    MemoryLocation output_memory_at(std::size_t index) const {
        throw_if_error();
        return memory_at(index);
    }

    /// Where the output called `name` lives (NOT_FOUND if there is none).
    MemoryLocation output_memory(const std::string &name) const {
        return output_memory_at(output_index(name));
    }

    /// Output `index` when it is in GPU memory: its device address, byte size and device
    /// (valid until this Response is destroyed). INVALID_ARGUMENT if the output is in
    /// host memory (read those with output_at); the response's error if it failed.
    DeviceTensor device_output_at(std::size_t index) const {
        throw_if_error();
        const Raw o = read(index);
        if (o.where.on_host()) {
            throw Error(INFER_STATUS_INVALID_ARGUMENT,
                        "output '" + o.name +
                            "' is in host memory, not GPU memory: read it with Response::output");
        }
        return DeviceTensor(o.name, o.dt, Shape(o.shape, o.shape + o.ndim), o.data, o.bytes,
                            o.where.device_id);
    }

    /// The output called `name` when it is in GPU memory (NOT_FOUND if there is none).
    DeviceTensor device_output(const std::string &name) const {
        return device_output_at(output_index(name));
    }

    /// The output called `name` as elements of T: `resp.output<float>("OUTPUT0")`.
    /// Throws INVALID_ARGUMENT when T is not the output's datatype or the output is in
    /// GPU memory.
    template <class T>
    TensorView<const T> output(const std::string &name) const {
        return output(name).as<T>();
    }

    /// An integer response parameter, or nullopt when absent (INVALID_ARGUMENT if it is
    /// not an integer).
    std::optional<int64_t> parameter_int(const std::string &key) const {
        int64_t v = 0;
        const Status st = infer_response_parameter_int(handle_.get(), key.c_str(), &v);
        if (st == INFER_STATUS_NOT_FOUND) {
            return std::nullopt;
        }
        detail::check(st);
        return v;
    }

    /// A string response parameter, or nullopt when absent.
    std::optional<std::string> parameter_string(const std::string &key) const {
        const char *v = nullptr;
        const Status st = infer_response_parameter_string(handle_.get(), key.c_str(), &v);
        if (st == INFER_STATUS_NOT_FOUND) {
            return std::nullopt;
        }
        detail::check(st);
        return std::string(v != nullptr ? v : "");
    }

    /// The C handle, still owned by this Response.
    infer_response *native_handle() const noexcept { return handle_.get(); }
    /// Gives up ownership: the caller frees the result with infer_response_free.
    infer_response *release() noexcept { return handle_.release(); }

    /// Frees the response now (this Response is empty afterwards), keeping its outputs in
    /// GPU memory from being reused until the work queued so far on `stream` (a
    /// cudaStream_t of their GPU) has run: for reads of them queued on a non-blocking
    /// stream and not waited for (infer_response_free_after_stream).
    void free_after_stream(void *stream) noexcept {
        infer_response_free_after_stream(handle_.release(), stream);
    }

private:
    /// One output as infer_response_output gives it, with its memory.
    struct Raw {
        std::string name;
        DataType dt = DataType::Invalid;
        const int64_t *shape = nullptr;
        uintptr_t ndim = 0;
        const void *data = nullptr;
        uintptr_t bytes = 0;
        MemoryLocation where;
    };

    Raw read(std::size_t index) const {
        const char *name = nullptr;
        infer_datatype dt = INFER_DATATYPE_INVALID;
        Raw o;
        detail::check(infer_response_output(handle_.get(), index, &name, &dt, &o.shape, &o.ndim,
                                            &o.data, &o.bytes));
        o.name = name != nullptr ? name : "";
        o.dt = static_cast<DataType>(dt);
        o.where = memory_at(index);
        return o;
    }

    MemoryLocation memory_at(std::size_t index) const {
        infer_memory_type mem = INFER_MEMORY_CPU;
        int64_t device_id = 0;
        detail::check(infer_response_output_memory(handle_.get(), index, &mem, &device_id));
        return MemoryLocation{static_cast<MemoryType>(mem), device_id};
    }

    /// The index of the output called `name`: the response's error if it failed,
    /// NOT_FOUND (the library's message) if it has no such output.
    std::size_t output_index(const std::string &name) const {
        throw_if_error();
        const std::size_t n = output_count();
        for (std::size_t i = 0; i < n; i++) {
            const char *oname = nullptr;
            detail::check(infer_response_output(handle_.get(), i, &oname, nullptr, nullptr,
                                                nullptr, nullptr, nullptr));
            if (oname != nullptr && name == oname) {
                return i;
            }
        }
        infer_datatype dt = INFER_DATATYPE_INVALID;
        const int64_t *shape = nullptr;
        uintptr_t ndim = 0;
        const void *data = nullptr;
        uintptr_t bytes = 0;
        detail::check(infer_response_output_by_name(handle_.get(), name.c_str(), &dt, &shape,
                                                    &ndim, &data, &bytes));
        throw Error(INFER_STATUS_NOT_FOUND, "the response has no output '" + name + "'");
    }

    struct Free {
        void operator()(infer_response *r) const noexcept { infer_response_free(r); }
    };
    std::unique_ptr<infer_response, Free> handle_;
};

} // namespace infer

#endif // INFER_CPP_RESPONSE_HPP
