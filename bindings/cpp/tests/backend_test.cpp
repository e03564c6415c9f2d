// Custom backends written in C++ through infer::Backend: results, batches, row errors,
// exceptions turned into error responses, and the lifetime of backends and instances.
#include <gtest/gtest.h>

#include <atomic>
#include <cctype>
#include <chrono>
#include <future>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <infer/infer.hpp>

#include "support.hpp"

using namespace std::chrono_literals;

namespace {

/// Counters a Scaler shares with the test.
struct Counters {
    std::atomic<int> instances_made{0};
    std::atomic<int> instances_gone{0};
    std::atomic<int> executions{0};
    std::mutex mu;
    std::vector<infer::InstanceInfo> infos;
};

/// OUT = IN x factor, FP32. IN = 13 throws a std::runtime_error, IN = 99 an infer::Error,
/// IN = 7 allocates the output with the wrong element type; a negative IN fails its row.
class ScalerInstance : public infer::Instance {
public:
    ScalerInstance(float factor, std::shared_ptr<Counters> c) : factor_(factor), c_(std::move(c)) {}
    ~ScalerInstance() override { c_->instances_gone++; }

    void execute(infer::Batch &batch) override {
        c_->executions++;
        const infer::TensorView<const float> in = batch.input<float>("IN");
        EXPECT_EQ(batch.input_count(), 1u);
        EXPECT_EQ(batch.input_at(0).name(), "IN");
        EXPECT_FALSE(batch.find_input("NOT_AN_INPUT").has_value());
        EXPECT_GE(batch.request_count(), 1u);
        EXPECT_EQ(in.shape()[0], static_cast<int64_t>(batch.size()));
        for (float v : in) {
            if (v == 13) {
                throw std::runtime_error("unlucky 13");
            }
            if (v == 99) {
                throw infer::Error(INFER_STATUS_RESOURCE_EXHAUSTED, "out of widgets");
            }
            if (v == 7) {
                (void)batch.output<double>("OUT", in.shape()); // FP32 in the config
            }
        }
        infer::TensorView<float> out = batch.output<float>("OUT", in.shape());
        const std::size_t cols = in.size() / batch.size();
        for (std::size_t i = 0; i < in.size(); i++) {
            out[i] = in[i] * factor_;
            if (in[i] < 0) {
                const auto row = static_cast<uint32_t>(i / cols);
                batch.set_row_error(row, INFER_STATUS_INVALID_ARGUMENT,
                                    "row " + std::to_string(row) + " is negative");
            }
        }
    }

private:
    float factor_;
    std::shared_ptr<Counters> c_;
};

class Scaler : public infer::Backend {
public:
    Scaler(float factor, std::shared_ptr<Counters> c) : factor_(factor), c_(std::move(c)) {}

    std::unique_ptr<infer::Instance> create_instance(const infer::InstanceInfo &info) override {
        {
            const std::lock_guard<std::mutex> lock(c_->mu);
            c_->infos.push_back(info);
        }
        if (info.model_name == "refuse") {
            throw std::invalid_argument("this backend refuses models called 'refuse'");
        }
        if (info.model_name == "unavailable") {
            throw infer::Error(INFER_STATUS_UNAVAILABLE, "no widgets today");
        }
        if (info.model_name == "nothing") {
            return nullptr;
        }
        c_->instances_made++;
        return std::make_unique<ScalerInstance>(factor_, c_);
    }

private:
    float factor_;
    std::shared_ptr<Counters> c_;
};

std::string scaler_config(int instances = 1, const std::string &extra = "") {
    return "backend: \"scaler\"\n"
           "max_batch_size: 8\n"
           "input [ { name: \"IN\" data_type: TYPE_FP32 dims: [ 2 ] } ]\n"
           "output [ { name: \"OUT\" data_type: TYPE_FP32 dims: [ 2 ] } ]\n"
           "instance_group [ { count: " + std::to_string(instances) + " kind: KIND_CPU } ]\n" +
           extra;
}

infer::Response scale(infer::Server &server, float a, float b, const std::string &model = "m") {
    return server.infer(server.request(model).input<float>("IN", {1, 2}, {a, b})).get();
}

} // namespace

TEST(CustomBackend, ComputesAndSeesItsInstanceInfo) {
    auto counters = std::make_shared<Counters>();
    infer::Server server;
    server.register_backend("scaler", std::make_shared<Scaler>(3.0f, counters));
    server.load_model("m", scaler_config(2));
    EXPECT_EQ(counters->instances_made.load(), 2);
    {
        const std::lock_guard<std::mutex> lock(counters->mu);
        ASSERT_EQ(counters->infos.size(), 2u);
        EXPECT_EQ(counters->infos[0].model_name, "m");
        EXPECT_EQ(counters->infos[0].gpu_device, -1);
        EXPECT_NE(counters->infos[0].model_config_json.find("\"OUT\""), std::string::npos)
            << counters->infos[0].model_config_json;
        EXPECT_NE(counters->infos[0].instance_index, counters->infos[1].instance_index);
    }
    infer::Response r = scale(server, 1.5f, -0.0f);
    ASSERT_TRUE(r.ok()) << r.error_message();
    EXPECT_EQ(r.output<float>("OUT").to_vector(), (std::vector<float>{4.5f, 0.0f}));
    EXPECT_EQ(r.output<float>("OUT").shape(), (infer::Shape{1, 2}));
}

TEST(CustomBackend, ExceptionInExecuteBecomesAnErrorResponse) {
    auto counters = std::make_shared<Counters>();
    infer::Server server;
    server.register_backend("scaler", std::make_shared<Scaler>(2.0f, counters));
    server.load_model("m", scaler_config());

    infer::Response r = scale(server, 13, 1);
    EXPECT_EQ(r.status(), INFER_STATUS_INTERNAL);
    EXPECT_NE(r.error_message().find("unlucky 13"), std::string::npos) << r.error_message();

    // An infer::Error keeps its code and message.
    r = scale(server, 99, 1);
    EXPECT_EQ(r.status(), INFER_STATUS_RESOURCE_EXHAUSTED);
    EXPECT_EQ(r.error_message(), "out of widgets");

    // A failing Batch call inside execute (output of the wrong element size) arrives the
    // same way, with the library's message.
    r = scale(server, 7, 1);
    EXPECT_EQ(r.status(), INFER_STATUS_INVALID_ARGUMENT);
    EXPECT_NE(r.error_message().find("byte size"), std::string::npos) << r.error_message();

    // The instance keeps serving.
    r = scale(server, 1, 2);
    ASSERT_TRUE(r.ok()) << r.error_message();
    EXPECT_EQ(r.output<float>("OUT").to_vector(), (std::vector<float>{2, 4}));
}

TEST(CustomBackend, RowErrorsFailOnlyTheirRequest) {
    auto counters = std::make_shared<Counters>();
    infer::Server server;
    server.register_backend("scaler", std::make_shared<Scaler>(10.0f, counters));
    server.load_model("m", scaler_config(1, "dynamic_batching { }"));
    server.pause_model("m"); // the three requests form one batch on resume
    std::future<infer::Response> a = server.infer(server.request("m").input<float>("IN", {1, 2}, {1, 2}));
    std::future<infer::Response> b = server.infer(server.request("m").input<float>("IN", {1, 2}, {-1, 2}));
    std::future<infer::Response> c = server.infer(server.request("m").input<float>("IN", {1, 2}, {3, 4}));
    server.resume_model("m");
    infer::Response ra = a.get(), rb = b.get(), rc = c.get();
    EXPECT_EQ(counters->executions.load(), 1);
    ASSERT_TRUE(ra.ok()) << ra.error_message();
    EXPECT_EQ(ra.output<float>("OUT").to_vector(), (std::vector<float>{10, 20}));
    EXPECT_EQ(rb.status(), INFER_STATUS_INVALID_ARGUMENT);
    EXPECT_EQ(rb.error_message(), "row 1 is negative");
    ASSERT_TRUE(rc.ok()) << rc.error_message();
    EXPECT_EQ(rc.output<float>("OUT").to_vector(), (std::vector<float>{30, 40}));
    EXPECT_NE(server.statistics_json("m").find("{\"size\":3,\"count\":1}"), std::string::npos)
        << server.statistics_json("m");
}

TEST(CustomBackend, ExceptionInCreateInstanceFailsTheLoadWithItsMessage) {
    auto counters = std::make_shared<Counters>();
    infer::Server server;
    server.register_backend("scaler", std::make_shared<Scaler>(1.0f, counters));
    try {
        server.load_model("refuse", scaler_config());
        FAIL() << "the load succeeded";
    } catch (const infer::Error &e) {
        EXPECT_EQ(e.code(), INFER_STATUS_INTERNAL);
        EXPECT_NE(e.message().find("refuse"), std::string::npos) << e.what();
        EXPECT_NE(e.message().find("this backend refuses models called 'refuse'"), std::string::npos)
            << e.what();
    }
    try {
        server.load_model("unavailable", scaler_config());
        FAIL() << "the load succeeded";
    } catch (const infer::Error &e) {
        EXPECT_EQ(e.code(), INFER_STATUS_UNAVAILABLE);
        EXPECT_NE(e.message().find("no widgets today"), std::string::npos) << e.what();
    }
    EXPECT_THROW(server.load_model("nothing", scaler_config()), infer::Error);
    EXPECT_FALSE(server.model_ready("refuse"));
    // The backend still serves other models.
    server.load_model("m", scaler_config());
    EXPECT_TRUE(scale(server, 1, 2).ok());
}

TEST(CustomBackend, LifetimeOfBackendsAndInstances) {
    auto counters = std::make_shared<Counters>();
    std::weak_ptr<infer::Backend> backend_alive;
    {
        auto backend = std::make_shared<Scaler>(1.0f, counters);
        backend_alive = backend;
        infer::ServerOptions opts;
        opts.register_backend("scaler", std::move(backend));
        infer::Server server(opts);
        EXPECT_FALSE(backend_alive.expired()); // the library holds it
        server.load_model("m", scaler_config(3));
        EXPECT_TRUE(scale(server, 1, 2).ok());
        // A name can be registered once.
        auto second = std::make_shared<Scaler>(1.0f, counters);
        std::weak_ptr<infer::Backend> second_alive = second;
        try {
            server.register_backend("scaler", std::move(second));
            FAIL() << "a backend name was registered twice";
        } catch (const infer::Error &e) {
            EXPECT_EQ(e.code(), INFER_STATUS_ALREADY_EXISTS);
        }
        EXPECT_TRUE(second_alive.expired()); // refused: released at once
        EXPECT_THROW(server.register_backend("x", nullptr), infer::Error);
    }
    // The server is gone: every instance was finalized and the backend released.
    EXPECT_EQ(counters->instances_made.load(), 3);
    EXPECT_EQ(counters->instances_gone.load(), 3);
    EXPECT_TRUE(backend_alive.expired());

    // Options that never made a server release their backends too.
    {
        auto backend = std::make_shared<Scaler>(1.0f, counters);
        backend_alive = backend;
        infer::ServerOptions opts;
        opts.register_backend("scaler", std::move(backend));
    }
    EXPECT_TRUE(backend_alive.expired());
}

namespace {

/// BYTES in, BYTES out: upper-cases each string.
class Upper : public infer::Backend {
    struct Inst : infer::Instance {
        void execute(infer::Batch &batch) override {
            const infer::Tensor in = batch.input("TEXT");
            std::vector<std::string> out;
            for (std::string_view s : in.strings()) {
                std::string u(s);
                for (char &ch : u) {
                    ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
                }
                out.push_back(std::move(u));
            }
            batch.output_strings("UPPER", in.shape(), out);
        }
    };

public:
    std::unique_ptr<infer::Instance> create_instance(const infer::InstanceInfo &) override {
        return std::make_unique<Inst>();
    }
};

/// A decoupled backend: for IN = [n], sends n responses OUT = [k] (k = 0..n-1) from a
/// thread of its own after execute returned, then a FINAL without outputs. n = -1 drops
/// the sender without a FINAL (the binding ends the request with an error).
class Countdown : public infer::Backend {
    struct Inst : infer::Instance {
        void execute(infer::Batch &batch) override {
            for (uint32_t i = 0; i < batch.request_count(); i++) {
                const int32_t n = batch.request_input(i, "IN").as<int32_t>()[0];
                EXPECT_EQ(batch.request_rows(i).second, 1u);
                infer::ResponseSender sender = batch.response_sender(i);
                if (n < 0) {
                    continue; // destroyed here, without a FINAL
                }
                std::thread([n, s = std::move(sender)]() mutable {
                    for (int32_t k = 0; k < n; k++) {
                        std::this_thread::sleep_for(5ms);
                        s.output<int32_t>("OUT", {1, 1})[0] = k;
                        s.send();
                    }
                    s.send_final();
                }).detach();
            }
        }
    };

public:
    std::unique_ptr<infer::Instance> create_instance(const infer::InstanceInfo &) override {
        return std::make_unique<Inst>();
    }
};

} // namespace

TEST(CustomBackend, DecoupledBackendStreamsFromItsOwnThread) {
    infer::Server server;
    server.register_backend("countdown", std::make_shared<Countdown>());
    server.load_model("countdown", "backend: \"countdown\"\nmax_batch_size: 4\n"
                                   "input [ { name: \"IN\" data_type: TYPE_INT32 dims: [ 1 ] } ]\n"
                                   "output [ { name: \"OUT\" data_type: TYPE_INT32 dims: [ 1 ] } ]\n"
                                   "model_transaction_policy { decoupled: true }\n");
    std::mutex mu;
    std::vector<int32_t> got;
    std::promise<bool> done;
    server.enqueue(server.request("countdown").input<int32_t>("IN", {1, 1}, {3}),
                   [&](infer::Response r, bool final) {
                       std::lock_guard<std::mutex> lock(mu);
                       if (final) {
                           done.set_value(r.ok() && r.output_count() == 0);
                           return;
                       }
                       got.push_back(r.output<int32_t>("OUT")[0]);
                   });
    ASSERT_TRUE(done.get_future().get());
    std::lock_guard<std::mutex> lock(mu);
    EXPECT_EQ(got, (std::vector<int32_t>{0, 1, 2}));

    // A sender dropped without its FINAL still ends the request.
    infer::Response r =
        server.infer(server.request("countdown").input<int32_t>("IN", {1, 1}, {-1})).get();
    EXPECT_EQ(r.status(), INFER_STATUS_INTERNAL);
    EXPECT_NE(r.error_message().find("without a FINAL"), std::string::npos) << r.error_message();
}

TEST(CustomBackend, BytesTensors) {
    infer::Server server;
    server.register_backend("upper", std::make_shared<Upper>());
    server.load_model("upper", "backend: \"upper\"\nmax_batch_size: 4\n"
                               "input [ { name: \"TEXT\" data_type: TYPE_STRING dims: [ 2 ] } ]\n"
                               "output [ { name: \"UPPER\" data_type: TYPE_STRING dims: [ 2 ] } ]\n");
    infer::Response r = server
                            .infer(server.request("upper").input_strings(
                                "TEXT", {1, 2}, std::vector<std::string>{"abc", "Hello, world"}))
                            .get();
    ASSERT_TRUE(r.ok()) << r.error_message();
    const auto got = r.output("UPPER").strings();
    ASSERT_EQ(got.size(), 2u);
    EXPECT_EQ(got[0], "ABC");
    EXPECT_EQ(got[1], "HELLO, WORLD");
}
