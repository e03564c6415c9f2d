// libinfer C++ binding: server options, the server, and the response callbacks.
//
// Server owns one infer_server. Response callbacks are heap holders (any callable) that
// the library hands back to one C trampoline; the trampoline catches every exception,
// reports it to the server's exception handler, and deletes the holder after the FINAL
// response. Functors the library may call (log callback, callbacks in flight) are kept
// alive until infer_server_free has returned.
#ifndef INFER_CPP_SERVER_HPP
#define INFER_CPP_SERVER_HPP

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "infer.h"
#include "infer/backend.hpp"
#include "infer/error.hpp"
#include "infer/request.hpp"
#include "infer/response.hpp"

namespace infer {

/// GPU use of a server.
enum class GpuMode : uint32_t {
    Auto = INFER_GPU_AUTO,         ///< use a GPU when there is one
    Off = INFER_GPU_OFF,           ///< never touch CUDA
    Required = INFER_GPU_REQUIRED, ///< the server fails with UNAVAILABLE without one
};

/// Severity of a log message.
enum class LogLevel : uint32_t {
    Error = INFER_LOG_ERROR,
    Warn = INFER_LOG_WARN,
    Info = INFER_LOG_INFO,
    Debug = INFER_LOG_DEBUG,
};

namespace detail {

/// Owned C strings the library returns.
inline std::string take_string(char *s) {
    struct Free {
        void operator()(char *p) const noexcept { infer_string_free(p); }
    };
    const std::unique_ptr<char, Free> owned(s);
    return owned ? std::string(owned.get()) : std::string();
}

struct LogSink {
    virtual ~LogSink() = default;
    virtual void log(LogLevel level, std::string_view message) = 0;
};

template <class F>
struct LogFunctor final : LogSink {
    explicit LogFunctor(F &&f) : fn(std::move(f)) {}
    void log(LogLevel level, std::string_view message) override { fn(level, message); }
    F fn;
};

extern "C" {
static inline void infer_cpp_log_trampoline(void *user_data, uint32_t level, const char *message) {
    try {
        static_cast<LogSink *>(user_data)->log(static_cast<LogLevel>(level),
                                               message != nullptr ? message : "");
    } catch (...) {
        // A failing log callback has nowhere to report to; it must not unwind into C.
    }
}
}

/// A generative model's iteration-statistics callback (a JSON object per iteration).
struct StatsSink {
    std::function<void(std::string_view)> fn;
};

static inline void infer_cpp_stats_trampoline(void *user_data, const char *json) {
    try {
        static_cast<StatsSink *>(user_data)->fn(json != nullptr ? std::string_view(json)
                                                                : std::string_view());
    } catch (...) {
        // Nowhere to report to; it must not unwind into C.
        std::fprintf(stderr, "infer: an iteration statistics callback threw\n");
    }
}

/// What a Server shares with its callbacks in flight: the handler for exceptions that
/// response callbacks throw.
class ServerState {
public:
    using Handler = std::function<void(std::exception_ptr)>;

    void set_handler(Handler h) {
        auto next = h ? std::make_shared<const Handler>(std::move(h)) : nullptr;
        const std::lock_guard<std::mutex> lock(mu_);
        handler_ = std::move(next);
    }

    uint64_t exception_count() const noexcept { return exceptions_.load(); }

    /// Called from the response trampoline's catch: never throws.
    void report(std::exception_ptr e) noexcept {
        exceptions_.fetch_add(1);
        std::shared_ptr<const Handler> h;
        {
            const std::lock_guard<std::mutex> lock(mu_);
            h = handler_;
        }
        try {
            if (h) {
                (*h)(e);
                return;
            }
            std::rethrow_exception(e);
        } catch (const std::exception &x) {
            std::fprintf(stderr, "infer: a response callback threw: %s\n", x.what());
        } catch (...) {
            std::fprintf(stderr, "infer: a response callback or its exception handler threw\n");
        }
    }

private:
    std::mutex mu_;
    std::shared_ptr<const Handler> handler_;
    std::atomic<uint64_t> exceptions_{0};
};

/// The functor of one enqueued request, owned by the library until its FINAL response.
struct ResponseCallback {
    explicit ResponseCallback(std::shared_ptr<ServerState> s) : state(std::move(s)) {}
    virtual ~ResponseCallback() = default;
    virtual void call(Response &&response, bool final) = 0;
    std::shared_ptr<ServerState> state;
};

template <class F>
struct ResponseFunctor final : ResponseCallback {
    ResponseFunctor(std::shared_ptr<ServerState> s, F &&f)
        : ResponseCallback(std::move(s)), fn(std::move(f)) {}
    void call(Response &&response, bool final) override {
        if constexpr (std::is_invocable_v<F &, Response, bool>) {
            fn(std::move(response), final);
        } else {
            fn(std::move(response));
        }
    }
    F fn;
};

extern "C" {
static inline void infer_cpp_response_trampoline(void *user_data, infer_response *response,
                                                 uint32_t flags) {
    auto *cb = static_cast<ResponseCallback *>(user_data);
    const bool final = (flags & INFER_RESPONSE_FLAG_FINAL) != 0;
    try {
        cb->call(Response(response), final);
    } catch (...) {
        cb->state->report(std::current_exception());
    }
    if (final) {
        delete cb; // the library never calls back for this request again
    }
}
}

} // namespace detail

/// Options for a Server: a builder over infer_server_options. Move-only; not
/// thread-safe. The options may be destroyed once the Server exists.
class ServerOptions {
public:
    ServerOptions() {
        infer_server_options *o = nullptr;
        detail::check(infer_server_options_new(&o));
        handle_.reset(o);
    }
    ServerOptions(ServerOptions &&) noexcept = default;
    ServerOptions &operator=(ServerOptions &&other) noexcept {
        if (this != &other) {
            handle_.reset(); // the C options go before the log functor they point to
            log_ = std::move(other.log_);
            handle_ = std::move(other.handle_);
        }
        return *this;
    }
    ServerOptions(const ServerOptions &) = delete;
    ServerOptions &operator=(const ServerOptions &) = delete;

    /// A Triton-style model repository: a folder of `<model>/config.pbtxt`.
    ServerOptions &model_repository(const std::string &path) {
        detail::check(infer_server_options_set_model_repository(handle(), path.c_str()));
        return *this;
    }

    /// true: the server loads only the startup models and what load_model asks for;
    /// false (default): every model of the repository at start-up.
    ServerOptions &explicit_model_control(bool on = true) {
        detail::check(infer_server_options_set_model_control_explicit(handle(), on));
        return *this;
    }

    /// A response cache of `bytes` for the models whose config enables it (0: none).
    ServerOptions &response_cache_bytes(uint64_t bytes) {
        detail::check(infer_server_options_set_response_cache_bytes(handle(), bytes));
        return *this;
    }

    /// Turns the rate limiter on or off (Triton's --rate-limit=execution_count): on,
    /// before each batch an instance takes the resources its instance_group's
    /// rate_limiter names, across every model, and priority 2 gets half the turns of
    /// priority 1. Off (the default), rate_limiter fields have no effect.
    ServerOptions &rate_limit(bool on) {
        detail::check(infer_server_options_set_rate_limit(
            handle(), on ? INFER_RATE_LIMIT_EXECUTION_COUNT : INFER_RATE_LIMIT_OFF));
        return *this;
    }

    /// Gives rate limiter resource `name` `count` units on GPU `device`, or with -1 for
    /// the global resource and every device without a size of its own (CPU instances
    /// count as device -1).
    ServerOptions &rate_limit_resource(const std::string &name, uint32_t count,
                                       int32_t device = -1) {
        detail::check(
            infer_server_options_add_rate_limit_resource(handle(), name.c_str(), count, device));
        return *this;
    }

    /// Polls the model repository every `period` (0: never, the default), as
    /// Server::poll_repository; needs a repository and no explicit model control.
    ServerOptions &repository_poll(std::chrono::milliseconds period) {
        detail::check(infer_server_options_set_repository_poll_ms(
            handle(), period.count() > 0 ? static_cast<uint64_t>(period.count()) : 0));
        return *this;
    }

    /// true: symbolic links in the repository (or a folder given to load_model) may lead
    /// out of it; false (default): every path a model names stays inside.
    ServerOptions &trusted_repository(bool on = true) {
        detail::check(infer_server_options_set_trusted_repository(handle(), on));
        return *this;
    }

    /// The ONNX Runtime library file for ONNX models (searched before the
    /// INFER_ONNXRUNTIME_LIBRARY environment variable, libinfer's directory and the
    /// loader's paths); "" clears it. One ONNX Runtime per process: the first server
    /// that loads an ONNX model decides.
    ServerOptions &onnxruntime_library(const std::string &path) {
        detail::check(infer_server_options_set_onnxruntime_library(handle(), path.c_str()));
        return *this;
    }

    /// true: ONNX models fail to load (UNAVAILABLE) where ONNX Runtime cannot be loaded,
    /// instead of running on tract.
    ServerOptions &onnxruntime_required(bool on = true) {
        detail::check(infer_server_options_set_onnxruntime_required(handle(), on));
        return *this;
    }

    /// One process-wide pool of `intra_op` (and `inter_op`) threads shared by every ONNX
    /// Runtime session that does not set its own counts; 0: one per core.
    ServerOptions &onnxruntime_threads(uint32_t intra_op, uint32_t inter_op = 1) {
        detail::check(infer_server_options_set_onnxruntime_threads(handle(), intra_op, inter_op));
        return *this;
    }

    /// With explicit model control, a repository model the server loads at start-up.
    ServerOptions &startup_model(const std::string &name) {
        detail::check(infer_server_options_add_startup_model(handle(), name.c_str()));
        return *this;
    }

    ServerOptions &gpu(GpuMode mode) {
        detail::check(infer_server_options_set_gpu(handle(), static_cast<uint32_t>(mode)));
        return *this;
    }

    /// Sends log messages of `min_level` and more severe to `fn(infer::LogLevel,
    /// std::string_view)`, called from library threads (make it thread-safe). Exceptions
    /// it throws are dropped. Every Server made from these options keeps the functor.
    template <class F>
    ServerOptions &log_callback(F &&fn, LogLevel min_level = LogLevel::Info) {
        using Fn = std::decay_t<F>;
        static_assert(std::is_invocable_v<Fn &, LogLevel, std::string_view>,
                      "a log callback is callable as f(infer::LogLevel, std::string_view)");
        auto sink = std::make_shared<detail::LogFunctor<Fn>>(Fn(std::forward<F>(fn)));
        detail::check(infer_server_options_set_log_callback(handle(),
                                                            static_cast<uint32_t>(min_level),
                                                            &detail::infer_cpp_log_trampoline,
                                                            static_cast<detail::LogSink *>(sink.get())));
        log_ = std::move(sink);
        return *this;
    }

    /// Back to the default log (errors and warnings to stderr).
    ServerOptions &default_log() {
        detail::check(infer_server_options_set_log_callback(
            handle(), static_cast<uint32_t>(LogLevel::Warn), nullptr, nullptr));
        log_.reset();
        return *this;
    }

    /// Registers a custom backend for the models the server loads at start-up (and
    /// later). The library keeps a reference until no server needs it.
    ServerOptions &register_backend(const std::string &name, std::shared_ptr<Backend> backend) {
        infer_server_options *o = handle();
        detail::register_backend(std::move(backend), [&](const infer_backend *cb, void *ud) {
            return infer_server_options_register_backend(o, name.c_str(), cb, ud);
        });
        return *this;
    }

    infer_server_options *native_handle() const noexcept { return handle_.get(); }

private:
    friend class Server;

    infer_server_options *handle() const {
        detail::require_handle(handle_.get(), "infer::ServerOptions");
        return handle_.get();
    }

    struct Free {
        void operator()(infer_server_options *o) const noexcept { infer_server_options_free(o); }
    };
    // Declared first, destroyed last: the C options may point to it.
    std::shared_ptr<detail::LogSink> log_;
    std::unique_ptr<infer_server_options, Free> handle_;
};

/// An inference server in this process. Move-only. Every member function may be called
/// from any thread at once (as the C API allows), including from response callbacks,
/// except shutdown, infer_sync and destruction, which must not run inside a callback.
/// Destruction drains: it waits (up to 30 s, then cancels) until every accepted request
/// got its FINAL response, so every future is ready and every callback done afterwards.
class Server {
public:
    /// A server with default options. Throws UNSUPPORTED if the library's C API is not
    /// compatible with this header.
    Server() { create(nullptr, nullptr); }

    /// A server from options (which may be destroyed afterwards). With a repository and
    /// no explicit control, every model is loaded; the first failure throws.
    explicit Server(const ServerOptions &options) {
        create(options.handle(), options.log_);
    }

    Server(Server &&other) noexcept
        : handle_(std::exchange(other.handle_, nullptr)), keep_(std::move(other.keep_)) {}
    Server &operator=(Server &&other) noexcept {
        if (this != &other) {
            destroy();
            handle_ = std::exchange(other.handle_, nullptr);
            keep_ = std::move(other.keep_);
        }
        return *this;
    }
    Server(const Server &) = delete;
    Server &operator=(const Server &) = delete;
    ~Server() { destroy(); }

    /// False once moved from.
    explicit operator bool() const noexcept { return handle_ != nullptr; }

    // ---- models ----

    /// Loads (or replaces) a model. `config` is config.pbtxt text or the same schema as
    /// JSON; empty reads `<model_dir>/config.pbtxt`. An empty `model_dir` means
    /// `<repository>/<name>` (or no folder).
    void load_model(const std::string &name, const std::string &config = {},
                    const std::string &model_dir = {}) {
        infer_server *s = handle();
        detail::last_instance_error().clear();
        check_load(infer_server_load_model(s, name.c_str(), config.empty() ? nullptr : config.c_str(),
                                           model_dir.empty() ? nullptr : model_dir.c_str()));
    }

    /// A file of a model loaded from memory: its path in the model folder
    /// ("1/model.onnx") and its bytes (the caller keeps them alive for the call).
    struct ModelFile {
        std::string path;
        std::string_view contents;
    };

    /// Loads (or replaces) a model from files in memory, as Triton's load with `file:`
    /// parameters: copied to a private folder that goes with the model.
    void load_model_files(const std::string &name, const std::string &config,
                          const std::vector<ModelFile> &files) {
        std::vector<const char *> paths;
        std::vector<const uint8_t *> contents;
        std::vector<size_t> sizes;
        for (const ModelFile &f : files) {
            paths.push_back(f.path.c_str());
            contents.push_back(reinterpret_cast<const uint8_t *>(f.contents.data()));
            sizes.push_back(f.contents.size());
        }
        detail::last_instance_error().clear();
        check_load(infer_server_load_model_files(handle(), name.c_str(), config.c_str(), paths.data(),
                                                 contents.data(), sizes.data(), files.size()));
    }

    /// Brings the loaded models in line with the repository: new folders load, changed
    /// ones reload, removed ones unload (no request fails); the first failure throws.
    void poll_repository() {
        detail::last_instance_error().clear();
        check_load(infer_server_poll_repository(handle()));
    }

    /// Triton's repository index as JSON: every model and version with its state
    /// (READY, LOADING, UNLOADING, UNAVAILABLE) and the reason of its last failure.
    std::string repository_index_json(bool ready_only = false) const {
        char *json = nullptr;
        detail::check(infer_server_repository_index_json(handle(), ready_only, &json));
        return detail::take_string(json);
    }

    /// Unloads a model after its queued and running requests finish.
    void unload_model(const std::string &name) {
        detail::check(infer_server_unload_model(handle(), name.c_str()));
    }

    /// Whether `version` (-1 = latest) of the model is loaded and serving.
    bool model_ready(const std::string &name, int64_t version = -1) const {
        bool ready = false;
        detail::check(infer_server_model_ready(handle(), name.c_str(), version, &ready));
        return ready;
    }

    /// The model's completed configuration as JSON.
    std::string model_config_json(const std::string &name, int64_t version = -1) const {
        char *json = nullptr;
        detail::check(infer_server_model_config_json(handle(), name.c_str(), version, &json));
        return detail::take_string(json);
    }

    /// Statistics of every model as JSON.
    std::string statistics_json() const {
        char *json = nullptr;
        detail::check(infer_server_statistics_json(handle(), nullptr, &json));
        return detail::take_string(json);
    }

    /// Statistics of one model as JSON.
    std::string statistics_json(const std::string &model) const {
        char *json = nullptr;
        detail::check(infer_server_statistics_json(handle(), model.c_str(), &json));
        return detail::take_string(json);
    }

    /// The same counters in Prometheus text format.
    std::string metrics_prometheus() const {
        char *text = nullptr;
        detail::check(infer_server_metrics_prometheus(handle(), &text));
        return detail::take_string(text);
    }

    /// Holds batch formation for a model until resume_model (requests are still
    /// accepted).
    void pause_model(const std::string &name) {
        detail::check(infer_server_pause_model(handle(), name.c_str()));
    }
    void resume_model(const std::string &name) {
        detail::check(infer_server_resume_model(handle(), name.c_str()));
    }

    /// Registers a custom backend; models using it can be loaded afterwards.
    /// ALREADY_EXISTS if the name is taken.
    void register_backend(const std::string &name, std::shared_ptr<Backend> backend) {
        infer_server *s = handle();
        detail::register_backend(std::move(backend), [&](const infer_backend *cb, void *ud) {
            return infer_server_register_backend(s, name.c_str(), cb, ud);
        });
    }

    // ---- requests ----

    /// A new request for `version` (-1 = latest) of `model`.
    Request request(const std::string &model, int64_t version = -1) const {
        return Request(handle(), model, version);
    }

    /// Sends a request and returns a future of its FINAL response (non-final responses
    /// of streaming models are dropped: use enqueue for those). Throws infer::Error at
    /// once when the request is not accepted (unknown model, invalid input, full queue,
    /// shutting down). The future always holds the Response, also when the model failed
    /// it: check `ok()` / `status()`, or call `throw_if_error()`; reading an output of a
    /// failed response throws its error.
    std::future<Response> infer(Request &&request) {
        std::promise<Response> promise;
        std::future<Response> future = promise.get_future();
        enqueue(std::move(request), [p = std::move(promise)](Response r, bool final) mutable {
            if (final) {
                p.set_value(std::move(r));
            }
        });
        return future;
    }

    /// Sends a request and waits for its FINAL response on this thread (through
    /// infer_server_infer). Throws when the request is not accepted, and when called
    /// from a response callback.
    Response infer_sync(Request &&request) {
        infer_server *s = handle();
        infer_request *r = request.release();
        detail::require_handle(r, "infer::Request");
        infer_response *out = nullptr;
        detail::check(infer_server_infer(s, r, &out)); // takes r, also on failure
        return Response(out);
    }

    /// Sends a request; `on_response(infer::Response, bool final)` (or
    /// `on_response(infer::Response)`) is called on a library thread once per response,
    /// the last call with final == true, after which the functor is destroyed. Calls for
    /// one request never overlap. It may enqueue and cancel requests, but must not block
    /// for long. An exception it throws is caught and passed to the exception handler
    /// (set_exception_handler); the request carries on. Throws infer::Error when the
    /// request is not accepted; the functor is then destroyed without being called.
    /// Returns the request id, for cancel.
    template <class F>
    uint64_t enqueue(Request &&request, F &&on_response) {
        using Fn = std::decay_t<F>;
        static_assert(std::is_invocable_v<Fn &, Response, bool> ||
                          std::is_invocable_v<Fn &, Response>,
                      "a response callback is callable as f(infer::Response, bool final) or "
                      "f(infer::Response)");
        infer_server *s = handle();
        detail::require_handle(request.native_handle(), "infer::Request");
        auto cb = std::make_unique<detail::ResponseFunctor<Fn>>(keep_->state,
                                                               Fn(std::forward<F>(on_response)));
        uint64_t id = 0;
        const Status st = infer_server_enqueue(s, request.release(),
                                               &detail::infer_cpp_response_trampoline,
                                               static_cast<detail::ResponseCallback *>(cb.get()), &id);
        // Read the message before the functor's destructor can run other failing calls.
        detail::check(st);
        cb.release(); // the trampoline deletes it after the FINAL response
        return id;
    }

    /// Cancels a request: a queued one ends at once with a FINAL CANCELLED response; a
    /// generative one that is generating stops after the current iteration, its FINAL
    /// CANCELLED with finish_reason "cancelled"; another executing one finishes normally.
    /// Returns false when the id is unknown or already finished.
    bool cancel(uint64_t request_id) {
        const Status st = infer_server_cancel(handle(), request_id);
        if (st == INFER_STATUS_NOT_FOUND) {
            return false;
        }
        detail::check(st);
        return true;
    }

    /// Stops accepting requests, lets queued and running ones finish, cancels what is
    /// left after `timeout`. Idempotent. Not from a response callback.
    void shutdown(std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
        detail::check(
            infer_server_shutdown(handle(), static_cast<uint64_t>(std::max<int64_t>(0, timeout.count()))));
    }

    /// Calls `fn(std::string_view json)` after each scheduler iteration of the generative
    /// model `model`, on its generation thread, with the iteration's statistics (see
    /// infer_server_set_iteration_stats_callback); an empty `fn` clears it. It stays set
    /// across reloads of the model. When this returns, a replaced callback no longer runs
    /// (unless this is called from that callback); every functor given is kept until the
    /// server is destroyed. What `fn` throws is printed to stderr and dropped. Throws NOT_FOUND for a model that is not
    /// loaded, INVALID_ARGUMENT for one that is not generative.
    void set_iteration_stats_callback(const std::string &model,
                                      std::function<void(std::string_view)> fn) {
        infer_server *s = handle();
        std::shared_ptr<detail::StatsSink> sink;
        if (fn) {
            sink = std::make_shared<detail::StatsSink>(detail::StatsSink{std::move(fn)});
            // Kept with the server: a callback may replace itself while it runs, so a
            // replaced functor is not destroyed before the server.
            const std::lock_guard<std::mutex> lock(keep_->stats_mu);
            keep_->stats.push_back(sink);
        }
        detail::check(infer_server_set_iteration_stats_callback(
            s, model.c_str(), sink ? &detail::infer_cpp_stats_trampoline : nullptr, sink.get()));
    }

    /// `handler(std::exception_ptr)` receives what response callbacks of this server
    /// throw, on the callback's thread; an empty handler restores the default (print to
    /// stderr). Exceptions the handler throws are dropped.
    void set_exception_handler(std::function<void(std::exception_ptr)> handler) {
        handle();
        keep_->state->set_handler(std::move(handler));
    }

    /// How many exceptions response callbacks of this server have thrown.
    uint64_t callback_exception_count() const noexcept {
        return keep_ ? keep_->state->exception_count() : 0;
    }

    infer_server *native_handle() const noexcept { return handle_; }

private:
    friend class Request;

    /// What must outlive the C server: the log functor, the state callbacks share, and
    /// the iteration-statistics callbacks.
    struct KeepAlive {
        std::shared_ptr<detail::LogSink> log;
        std::shared_ptr<detail::ServerState> state;
        std::mutex stats_mu;
        std::vector<std::shared_ptr<detail::StatsSink>> stats;
    };

    void create(const infer_server_options *options, std::shared_ptr<detail::LogSink> log) {
        require_compatible_api(library_api_version());
        auto keep = std::make_unique<KeepAlive>();
        keep->log = std::move(log);
        keep->state = std::make_shared<detail::ServerState>();
        infer_server *s = nullptr;
        detail::last_instance_error().clear();
        check_load(infer_server_new(options, &s));
        handle_ = s;
        keep_ = std::move(keep);
    }

    /// Like detail::check, adding what create_instance of a C++ backend threw on this
    /// thread (instance_init can return only a status).
    static void check_load(Status st) {
        std::string &extra = detail::last_instance_error();
        if (st == INFER_STATUS_OK) {
            extra.clear();
            return;
        }
        std::string message = infer_last_error_message();
        if (!extra.empty()) {
            message += " (create_instance: " + extra + ")";
            extra.clear();
        }
        throw Error(st, message);
    }

    infer_server *handle() const {
        detail::require_handle(handle_, "infer::Server");
        return handle_;
    }

    void destroy() noexcept {
        if (handle_ == nullptr) {
            return;
        }
        // handle_ stays set while the server drains: callbacks still running may use it
        // (and get UNAVAILABLE for new requests).
        if (infer_server_shutdown(handle_, 30000) != INFER_STATUS_OK) {
            // Refused inside a response callback: the C API keeps the server alive (and
            // logs why), so what its threads may still call must stay alive too.
            infer_server_free(handle_);
            handle_ = nullptr;
            (void)keep_.release();
            return;
        }
        infer_server_free(handle_);
        handle_ = nullptr;
        keep_.reset();
    }

    infer_server *handle_ = nullptr;
    std::unique_ptr<KeepAlive> keep_;
};

inline Request::Request(const Server &server, const std::string &model, int64_t version)
    : Request(server.handle(), model, version) {}

} // namespace infer

#endif // INFER_CPP_SERVER_HPP
