// libinfer C++ binding: custom backends written in C++.
//
// A Backend makes one Instance per model instance; the library calls Instance::execute
// with each batch. The C callbacks of infer_backend are trampolines here: they catch
// every exception and turn it into a status and a message, so nothing unwinds into the
// library. The registered Backend is kept by a heap holder that the library's
// `finalize` deletes.
#ifndef INFER_CPP_BACKEND_HPP
#define INFER_CPP_BACKEND_HPP

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "infer.h"
#include "infer/error.hpp"
#include "infer/tensor.hpp"

namespace infer {

namespace detail {

/// What Batch and ResponseSender share: typed and BYTES outputs built on the owner's
/// output_raw(name, shape, byte_size) (CRTP).
template <class Owner>
class OutputAllocator {
public:
    /// Allocates output `name` with `shape`, zeroed, for the backend to fill. The library
    /// checks the byte size of shape x sizeof(T) against the config's datatype, so a T of
    /// the wrong size throws INVALID_ARGUMENT; T must be the config's datatype.
    template <class T>
    TensorView<T> output(const std::string &name, const Shape &shape) {
        static_assert(!std::is_const_v<T>, "outputs are written: use a non-const T");
        const std::size_t n = element_count(shape);
        void *p = owner().output_raw(name, shape, n * sizeof(T));
        return TensorView<T>(static_cast<T *>(p), n, shape, name);
    }

    /// Allocates and fills a BYTES output, one element per string (rows in order).
    template <class Strings>
    void output_strings(const std::string &name, const Shape &shape, const Strings &strings) {
        const std::vector<char> bytes = encode_bytes(strings);
        void *p = owner().output_raw(name, shape, bytes.size());
        if (!bytes.empty()) {
            std::memcpy(p, bytes.data(), bytes.size());
        }
    }

private:
    Owner &owner() { return static_cast<Owner &>(*this); }
};

} // namespace detail

/// A decoupled model's handle on one request (Batch::response_sender): the backend sends
/// that request 0..n responses and then the FINAL, from any thread, during execute or
/// after it returned. Move-only; use it on one thread at a time. A sender destroyed
/// before its FINAL ends the request with an INTERNAL error response, so no request is
/// left without one.
class ResponseSender : public detail::OutputAllocator<ResponseSender> {
public:
    explicit ResponseSender(infer_response_sender *s) noexcept : s_(s) {}
    ResponseSender(ResponseSender &&o) noexcept : s_(std::exchange(o.s_, nullptr)) {}
    ResponseSender &operator=(ResponseSender &&o) noexcept {
        if (this != &o) {
            abandon();
            s_ = std::exchange(o.s_, nullptr);
        }
        return *this;
    }
    ResponseSender(const ResponseSender &) = delete;
    ResponseSender &operator=(const ResponseSender &) = delete;
    ~ResponseSender() { abandon(); }

    // output<T>(name, shape) and output_strings(name, shape, strings) allocate the next
    // response's outputs (OutputAllocator): the shape after a batch dim of any size where
    // the model batches; the buffers are the backend's to fill until send().

    /// Allocates output `name` of exactly `byte_size` bytes (required for BYTES).
    void *output_raw(const std::string &name, const Shape &shape, std::size_t byte_size) {
        void *p = nullptr;
        detail::check(infer_response_sender_output_bytes(live(), name.c_str(), shape.data(),
                                                         shape.size(), byte_size, &p));
        return p;
    }

    /// Sends the outputs allocated since the last send as one (non-final) response.
    void send() { detail::check(infer_response_sender_send(live(), 0)); }

    /// Sends the outputs allocated since the last send (maybe none) as the FINAL; the
    /// sender is spent afterwards, whatever the outcome.
    void send_final() {
        infer_response_sender *s = std::exchange(s_, nullptr);
        detail::require_handle(s, "infer::ResponseSender");
        detail::check(infer_response_sender_send(s, INFER_RESPONSE_FLAG_FINAL));
    }

    /// Ends the request with an error response (FINAL); the sender is spent.
    void send_error(Status code, const std::string &message) {
        infer_response_sender *s = std::exchange(s_, nullptr);
        detail::require_handle(s, "infer::ResponseSender");
        detail::check(infer_response_sender_send_error(s, code, message.c_str()));
    }

    /// Whether the caller cancelled the request (the backend may stop early).
    bool cancelled() const noexcept { return infer_response_sender_is_cancelled(s_); }

    /// False once the FINAL was sent (or the sender was moved from).
    explicit operator bool() const noexcept { return s_ != nullptr; }

private:
    infer_response_sender *live() const {
        detail::require_handle(s_, "infer::ResponseSender");
        return s_;
    }

    void abandon() noexcept {
        if (s_ != nullptr) {
            infer_response_sender_send_error(
                std::exchange(s_, nullptr), INFER_STATUS_INTERNAL,
                "the C++ backend dropped the request's ResponseSender without a FINAL");
        }
    }

    infer_response_sender *s_;
};

/// One execution's requests: batched inputs to read, outputs to allocate and fill, and
/// per-row errors. Valid only during Instance::execute, like every Tensor and TensorView
/// read from it. Not thread-safe; use it on the thread that runs execute.
class Batch : public detail::OutputAllocator<Batch> {
public:
    explicit Batch(infer_batch *b) noexcept : b_(b) {}
    Batch(const Batch &) = delete;
    Batch &operator=(const Batch &) = delete;

    /// Rows in this execution: the sum of the requests' batch sizes (the number of
    /// requests where the model does not batch).
    uint32_t size() const noexcept { return infer_batch_size(b_); }
    /// Requests in this execution.
    uint32_t request_count() const noexcept { return infer_batch_request_count(b_); }
    /// Batched inputs present (optional inputs no request gave are absent).
    uint32_t input_count() const noexcept { return infer_batch_input_count(b_); }

    /// Whether this batch runs on a GPU instance: then every input is in device memory
    /// (read it with device_input), outputs can be allocated there (output_device), and
    /// cuda_stream() is the stream to queue work on.
    bool on_gpu() const noexcept { return infer_batch_cuda_stream(b_) != nullptr; }

    /// The instance's CUDA stream (a CUstream), or nullptr on a CPU instance.
    void *cuda_stream() const noexcept { return infer_batch_cuda_stream(b_); }

    /// Where batched input `name` is (NOT_FOUND when absent).
    MemoryLocation input_memory(const std::string &name) const {
        infer_memory_type mem = INFER_MEMORY_CPU;
        int64_t device = 0;
        detail::check(infer_batch_input_memory(b_, name.c_str(), &mem, &device));
        return MemoryLocation{static_cast<MemoryType>(mem), device};
    }

    /// Batched input `index` (< input_count()), with its name. Host memory only: on a
    /// GPU instance it throws INVALID_ARGUMENT (use device_input).
    Tensor input_at(uint32_t index) const {
        const char *name = nullptr;
        infer_datatype dt = INFER_DATATYPE_INVALID;
        const int64_t *shape = nullptr;
        uintptr_t ndim = 0;
        const void *data = nullptr;
        uintptr_t bytes = 0;
        detail::check(
            infer_batch_input_by_index(b_, index, &name, &dt, &shape, &ndim, &data, &bytes));
        const std::string n = name != nullptr ? name : "";
        host_only(n);
        return Tensor(n, static_cast<DataType>(dt), Shape(shape, shape + ndim), data, bytes);
    }

    /// The batched input `name` in device memory, on a GPU instance (INVALID_ARGUMENT on
    /// a CPU instance, NOT_FOUND when absent).
    DeviceTensor device_input(const std::string &name) const {
        const MemoryLocation where = input_memory(name);
        if (where.on_host()) {
            throw Error(INFER_STATUS_INVALID_ARGUMENT,
                        "input '" + name + "' is in host memory (this instance runs on the CPU): "
                        "read it with Batch::input");
        }
        infer_datatype dt = INFER_DATATYPE_INVALID;
        const int64_t *shape = nullptr;
        uintptr_t ndim = 0;
        const void *data = nullptr;
        uintptr_t bytes = 0;
        detail::check(infer_batch_input(b_, name.c_str(), &dt, &shape, &ndim, &data, &bytes));
        return DeviceTensor(name, static_cast<DataType>(dt), Shape(shape, shape + ndim), data,
                            bytes, where.device_id);
    }

    /// On a GPU instance: allocates the batched output `name` in device memory and
    /// returns its device address, for work queued on cuda_stream() to fill.
    void *output_device(const std::string &name, const Shape &shape) {
        void *p = nullptr;
        detail::check(infer_batch_output_device(b_, name.c_str(), shape.data(), shape.size(), &p));
        return p;
    }

    /// The batched input `name` (the rows of all requests along dim 0; sequence
    /// controls and implicit state appear under their configured names), or nullopt
    /// when no request of the batch has it.
    std::optional<Tensor> find_input(const std::string &name) const {
        infer_datatype dt = INFER_DATATYPE_INVALID;
        const int64_t *shape = nullptr;
        uintptr_t ndim = 0;
        const void *data = nullptr;
        uintptr_t bytes = 0;
        const Status st = infer_batch_input(b_, name.c_str(), &dt, &shape, &ndim, &data, &bytes);
        if (st == INFER_STATUS_NOT_FOUND) {
            return std::nullopt;
        }
        detail::check(st);
        host_only(name);
        return Tensor(name, static_cast<DataType>(dt), Shape(shape, shape + ndim), data, bytes);
    }

    /// The batched input `name`; NOT_FOUND when absent.
    Tensor input(const std::string &name) const {
        std::optional<Tensor> t = find_input(name);
        if (!t) {
            throw Error(INFER_STATUS_NOT_FOUND, "the batch has no input '" + name + "'");
        }
        return std::move(*t);
    }

    /// The batched input `name` as elements of T (INVALID_ARGUMENT on a datatype
    /// mismatch).
    template <class T>
    TensorView<const T> input(const std::string &name) const {
        return input(name).as<T>();
    }

    // output<T>(name, shape) allocates the batched output `name` (dim 0 = size() where the
    // model batches) and output_strings(name, shape, strings) a BYTES one, rows in batch
    // order (OutputAllocator).

    /// Allocates output `name` of exactly `byte_size` bytes (required for BYTES; checked
    /// against the shape for other datatypes) and returns its zeroed buffer.
    void *output_raw(const std::string &name, const Shape &shape, std::size_t byte_size) {
        void *p = nullptr;
        detail::check(infer_batch_output_bytes(b_, name.c_str(), shape.data(), shape.size(),
                                               byte_size, &p));
        return p;
    }

    /// Where request `index` (< request_count()) is in the batch: its first row and its
    /// number of rows.
    std::pair<uint32_t, uint32_t> request_rows(uint32_t index) const {
        uint32_t first = 0;
        uint32_t rows = 0;
        detail::check(infer_batch_request_rows(b_, index, &first, &rows));
        return {first, rows};
    }

    /// Input `name` of request `index` alone, in the shape that request gave (a ragged
    /// batch's rows before they were concatenated). Host memory on a CPU instance.
    Tensor request_input(uint32_t index, const std::string &name) const {
        infer_datatype dt = INFER_DATATYPE_INVALID;
        const int64_t *shape = nullptr;
        uintptr_t ndim = 0;
        const void *data = nullptr;
        uintptr_t bytes = 0;
        detail::check(infer_batch_request_input(b_, index, name.c_str(), &dt, &shape, &ndim,
                                                &data, &bytes));
        host_only(name);
        return Tensor(name, static_cast<DataType>(dt), Shape(shape, shape + ndim), data, bytes);
    }

    /// For a decoupled model: takes request `index`'s response sender; the library then
    /// does not answer that request from the batch's outputs. Its inputs stay valid only
    /// until execute returns.
    ResponseSender response_sender(uint32_t index) {
        infer_response_sender *s = nullptr;
        detail::check(infer_batch_response_sender(b_, index, &s));
        return ResponseSender(s);
    }

    /// Fails the request that holds row `row` with `code` and `message`; the other
    /// requests of the batch are answered normally.
    void set_row_error(uint32_t row, Status code, const std::string &message) {
        detail::check(infer_batch_set_request_error(b_, row, code, message.c_str()));
    }

    /// The message every request gets when execute fails as a whole. The binding sets it
    /// from the exception that leaves execute, so backends rarely need it.
    void set_error_message(const std::string &message) {
        detail::check(infer_batch_set_error_message(b_, message.c_str()));
    }

    infer_batch *native_handle() const noexcept { return b_; }

private:
    /// Host tensors are never made from device addresses.
    void host_only(const std::string &name) const {
        if (on_gpu()) {
            throw Error(INFER_STATUS_INVALID_ARGUMENT,
                        "input '" + name + "' is in device memory (this instance runs on a GPU): "
                        "read it with Batch::device_input");
        }
    }

    infer_batch *b_;
};

/// What a Backend learns about the instance it makes.
struct InstanceInfo {
    std::string model_name;
    /// The model's completed configuration as JSON (Triton's field names).
    std::string model_config_json;
    uint32_t instance_index;
    /// -1 on the CPU.
    int32_t gpu_device;
};

/// One model instance of a custom backend. execute runs on the instance's worker thread,
/// one batch at a time. An exception leaving execute fails every request of the batch:
/// an infer::Error with its code and message, anything else INTERNAL with what().
/// To fail single requests, use Batch::set_row_error and return normally.
class Instance {
public:
    virtual ~Instance() = default;
    virtual void execute(Batch &batch) = 0;
};

/// A custom backend: register it under a name with ServerOptions::register_backend or
/// Server::register_backend, then load models with `backend: "<name>"`. The library keeps
/// it (shared) until no server needs it. create_instance may run on several threads at
/// once (different models); an exception from it fails the load of the model.
class Backend {
public:
    virtual ~Backend() = default;
    virtual std::unique_ptr<Instance> create_instance(const InstanceInfo &info) = 0;
};

namespace detail {

/// The last exception message of create_instance on this thread: the C API carries
/// only a status out of instance_init, so the binding adds the message to the load
/// error it throws on the same thread.
inline std::string &last_instance_error() {
    thread_local std::string message;
    return message;
}

inline void note_instance_error(const char *what) noexcept {
    try {
        last_instance_error() = what;
    } catch (...) {
        // Out of memory: the load error keeps the library's own message only.
    }
}

/// Puts an exception's message on a failed batch; returns the status execute reports.
inline Status fail_batch(infer_batch *b, Status code, const char *prefix,
                         const char *what) noexcept {
    try {
        const std::string msg = std::string(prefix) + what;
        infer_batch_set_error_message(b, msg.c_str());
    } catch (...) {
        infer_batch_set_error_message(b, what);
    }
    return code == INFER_STATUS_OK ? INFER_STATUS_INTERNAL : code;
}

/// What `backend_user_data` points to: the registered Backend, owned by the library.
struct BackendHolder {
    std::shared_ptr<Backend> backend;
};

extern "C" {

static inline uint32_t infer_cpp_instance_init(void *backend_user_data, const char *model_name,
                                               const char *model_config_json,
                                               uint32_t instance_index, int32_t gpu_device,
                                               void **instance_state) {
    try {
        auto *holder = static_cast<BackendHolder *>(backend_user_data);
        const InstanceInfo info{model_name != nullptr ? model_name : "",
                                model_config_json != nullptr ? model_config_json : "",
                                instance_index, gpu_device};
        std::unique_ptr<Instance> instance = holder->backend->create_instance(info);
        if (!instance) {
            note_instance_error("create_instance returned no instance");
            return INFER_STATUS_INTERNAL;
        }
        *instance_state = instance.release();
        return INFER_STATUS_OK;
    } catch (const Error &e) {
        note_instance_error(e.message().c_str());
        return e.code() == INFER_STATUS_OK ? INFER_STATUS_INTERNAL : e.code();
    } catch (const std::exception &e) {
        note_instance_error(e.what());
        return INFER_STATUS_INTERNAL;
    } catch (...) {
        note_instance_error("create_instance threw an exception that is not a std::exception");
        return INFER_STATUS_INTERNAL;
    }
}

static inline uint32_t infer_cpp_execute(void *instance_state, infer_batch *b) {
    try {
        Batch batch(b);
        static_cast<Instance *>(instance_state)->execute(batch);
        return INFER_STATUS_OK;
    } catch (const Error &e) {
        return fail_batch(b, e.code(), "", e.message().c_str());
    } catch (const std::exception &e) {
        return fail_batch(b, INFER_STATUS_INTERNAL, "the C++ backend's execute threw: ", e.what());
    } catch (...) {
        return fail_batch(b, INFER_STATUS_INTERNAL, "",
                          "the C++ backend's execute threw an exception that is not a "
                          "std::exception");
    }
}

static inline void infer_cpp_instance_fini(void *instance_state) {
    delete static_cast<Instance *>(instance_state);
}

static inline void infer_cpp_finalize(void *backend_user_data) {
    delete static_cast<BackendHolder *>(backend_user_data);
}

} // extern "C"

/// Registers `backend` through `reg(const infer_backend *, void *user_data)` (the options'
/// or the server's register function). On failure the holder is freed here, after the
/// error message was read.
template <class Register>
void register_backend(std::shared_ptr<Backend> backend, Register &&reg) {
    require_handle(backend.get(), "infer::Backend");
    auto holder = std::make_unique<BackendHolder>(BackendHolder{std::move(backend)});
    infer_backend callbacks{};
    callbacks.struct_size = sizeof(infer_backend);
    callbacks.instance_init = &infer_cpp_instance_init;
    callbacks.execute = &infer_cpp_execute;
    callbacks.instance_fini = &infer_cpp_instance_fini;
    callbacks.finalize = &infer_cpp_finalize;
    check(reg(&callbacks, static_cast<void *>(holder.get())));
    holder.release(); // the library's finalize deletes it
}

} // namespace detail

} // namespace infer

#endif // INFER_CPP_BACKEND_HPP
