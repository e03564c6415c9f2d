// libinfer C++ binding: errors, status codes and the C API version check.
//
// Owns the one place that turns an infer_status into an exception (detail::check) and
// the compatibility rule between this header and the loaded library. Never calls
// anything that can fail without checking it.
#ifndef INFER_CPP_ERROR_HPP
#define INFER_CPP_ERROR_HPP

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>

#include "infer.h"

namespace infer {

/// A status code of the C API: INFER_STATUS_OK (0) or one of the INFER_STATUS_* errors.
using Status = infer_status;

/// The name of a status code, e.g. "INVALID_ARGUMENT" (static string).
inline const char *status_name(Status code) noexcept { return infer_status_string(code); }

/// What every failing call of this binding throws. `code()` is the C API's status,
/// `message()` the library's message (infer_last_error_message() of the failing call, or
/// a failed response's error message); `what()` is "STATUS_NAME: message".
class Error : public std::runtime_error {
public:
    Error(Status code, const std::string &message)
        : std::runtime_error(std::string(infer_status_string(code)) + ": " + message),
          code_(code), message_(message) {}

    /// The infer_status of the failure (never INFER_STATUS_OK).
    Status code() const noexcept { return code_; }
    /// The status's name, e.g. "NOT_FOUND".
    const char *status_name() const noexcept { return infer_status_string(code_); }
    /// The message alone, without the status name.
    const std::string &message() const noexcept { return message_; }

private:
    Status code_;
    std::string message_;
};

namespace detail {

/// Throws infer::Error for a failed C call, with this thread's last error message (read
/// at once, before anything else can replace it).
inline void check(Status status) {
    if (status != INFER_STATUS_OK) {
        throw Error(status, infer_last_error_message());
    }
}

/// Throws INVALID_ARGUMENT when a wrapper's handle is gone (moved from, or already
/// handed to the library), instead of passing NULL down.
template <class Handle>
inline void require_handle(const Handle *h, const char *what) {
    if (h == nullptr) {
        throw Error(INFER_STATUS_INVALID_ARGUMENT,
                    std::string(what) + " is empty (moved from, or already sent)");
    }
}

} // namespace detail

/// A C API version: MAJOR.MINOR.
struct ApiVersion {
    uint32_t major;
    uint32_t minor;
};

/// The C API version this header was written against (INFER_API_VERSION_* of infer.h).
constexpr ApiVersion header_api_version() noexcept {
    return ApiVersion{INFER_API_VERSION_MAJOR, INFER_API_VERSION_MINOR};
}

/// The C API version the loaded library implements.
inline ApiVersion library_api_version() {
    ApiVersion v{0, 0};
    detail::check(infer_api_version(&v.major, &v.minor));
    return v;
}

/// The library's own version, e.g. "0.1.0".
inline std::string library_version() { return infer_version(); }

/// Throws UNSUPPORTED unless a library implementing C API `library` can serve this
/// header: the same major and a minor at least as high as the header's.
inline void require_compatible_api(ApiVersion library) {
    const ApiVersion header = header_api_version();
    if (library.major == header.major && library.minor >= header.minor) {
        return;
    }
    throw Error(INFER_STATUS_UNSUPPORTED,
                "libinfer implements C API " + std::to_string(library.major) + "." +
                    std::to_string(library.minor) + ", but infer.hpp was built against " +
                    std::to_string(header.major) + "." + std::to_string(header.minor) +
                    " and needs major " + std::to_string(header.major) + " with minor >= " +
                    std::to_string(header.minor) +
                    ": link the libinfer.so that matches include/infer.h");
}

} // namespace infer

#endif // INFER_CPP_ERROR_HPP
