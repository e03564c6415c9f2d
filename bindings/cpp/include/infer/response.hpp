// libinfer C++ binding: the response to a request.
//
// Response owns one infer_response and frees it on destruction (on any thread, as the C
// API allows). Reading outputs of a failed response throws that response's error.
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
/// a Tensor or TensorView read from it is valid until the Response is destroyed (moving
/// the Response keeps them valid). The accessors may be called from any thread, but one
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

    /// Output `index` (0-based); throws the response's error if it failed.
    Tensor output_at(std::size_t index) const {
        throw_if_error();
        const char *name = nullptr;
        infer_datatype dt = INFER_DATATYPE_INVALID;
        const int64_t *shape = nullptr;
        uintptr_t ndim = 0;
        const void *data = nullptr;
        uintptr_t bytes = 0;
        detail::check(
            infer_response_output(handle_.get(), index, &name, &dt, &shape, &ndim, &data, &bytes));
        return Tensor(name != nullptr ? name : "", static_cast<DataType>(dt),
                      Shape(shape, shape + ndim), data, bytes);
    }

    /// The output called `name`: NOT_FOUND if the response has none of that name; the
    /// response's own error if it failed.
    Tensor output(const std::string &name) const {
        throw_if_error();
        infer_datatype dt = INFER_DATATYPE_INVALID;
        const int64_t *shape = nullptr;
        uintptr_t ndim = 0;
        const void *data = nullptr;
        uintptr_t bytes = 0;
        detail::check(infer_response_output_by_name(handle_.get(), name.c_str(), &dt, &shape,
                                                    &ndim, &data, &bytes));
        return Tensor(name, static_cast<DataType>(dt), Shape(shape, shape + ndim), data, bytes);
    }

    /// The output called `name` as elements of T: `resp.output<float>("OUTPUT0")`.
    /// Throws INVALID_ARGUMENT when T is not the output's datatype.
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

private:
    struct Free {
        void operator()(infer_response *r) const noexcept { infer_response_free(r); }
    };
    std::unique_ptr<infer_response, Free> handle_;
};

} // namespace infer

#endif // INFER_CPP_RESPONSE_HPP
