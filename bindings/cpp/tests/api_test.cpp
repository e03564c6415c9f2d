// The C API version check, errors with their codes, server options and model management.
#include <gtest/gtest.h>

#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <type_traits>

#include <infer/infer.hpp>

#include "support.hpp"

using infer::ApiVersion;

TEST(ApiVersion, LibraryMatchesHeader) {
    const ApiVersion lib = infer::library_api_version();
    EXPECT_EQ(lib.major, static_cast<uint32_t>(INFER_API_VERSION_MAJOR));
    EXPECT_GE(lib.minor, static_cast<uint32_t>(INFER_API_VERSION_MINOR));
    EXPECT_NO_THROW(infer::require_compatible_api(lib));
    EXPECT_FALSE(infer::library_version().empty());
}

TEST(ApiVersion, CompatibilityRule) {
    const ApiVersion h = infer::header_api_version();
    // A newer minor is fine, a different major never is.
    EXPECT_NO_THROW(infer::require_compatible_api({h.major, h.minor}));
    EXPECT_NO_THROW(infer::require_compatible_api({h.major, h.minor + 5}));
    try {
        infer::require_compatible_api({h.major + 1, h.minor});
        FAIL() << "a different major version was accepted";
    } catch (const infer::Error &e) {
        EXPECT_EQ(e.code(), INFER_STATUS_UNSUPPORTED);
        const std::string want = "C API " + std::to_string(h.major + 1) + "." +
                                 std::to_string(h.minor);
        EXPECT_NE(e.message().find(want), std::string::npos) << e.what();
        EXPECT_NE(e.message().find("needs major " + std::to_string(h.major)), std::string::npos)
            << e.what();
    }
    if (h.minor > 0) {
        EXPECT_THROW(infer::require_compatible_api({h.major, h.minor - 1}), infer::Error);
    }
}

TEST(Errors, CarryCodeAndLibraryMessage) {
    static_assert(std::is_base_of_v<std::runtime_error, infer::Error>);
    infer::Server server;
    try {
        server.load_model("broken", "backend: \"add_sub\"\nmax_batch_size: -3 bogus_field: 1\n");
        FAIL() << "a broken config loaded";
    } catch (const infer::Error &e) {
        EXPECT_EQ(e.code(), INFER_STATUS_INVALID_ARGUMENT);
        EXPECT_STREQ(e.status_name(), "INVALID_ARGUMENT");
        EXPECT_FALSE(e.message().empty());
        // what() is "STATUS: message".
        EXPECT_EQ(std::string(e.what()), "INVALID_ARGUMENT: " + e.message());
    }
    try {
        (void)server.request("no_such_model");
        FAIL() << "a request for an unknown model was made";
    } catch (const infer::Error &e) {
        EXPECT_EQ(e.code(), INFER_STATUS_NOT_FOUND);
        EXPECT_NE(e.message().find("no_such_model"), std::string::npos) << e.what();
    }
    EXPECT_THROW(server.unload_model("no_such_model"), infer::Error);
    EXPECT_THROW(server.pause_model("no_such_model"), infer::Error);
    EXPECT_FALSE(server.cancel(987654321)); // unknown ids are not an error
    EXPECT_STREQ(infer::status_name(INFER_STATUS_DEADLINE_EXCEEDED), "DEADLINE_EXCEEDED");
}

TEST(Errors, InvalidInputsThrowAtTheSetter) {
    infer::Server server;
    server.load_model("add_sub", support::add_sub_config());
    infer::Request req = server.request("add_sub");
    // Wrong element count, wrong datatype, unknown input.
    try {
        req.input<float>("INPUT0", {1, 4}, {1, 2, 3});
        FAIL();
    } catch (const infer::Error &e) {
        EXPECT_EQ(e.code(), INFER_STATUS_INVALID_ARGUMENT);
        EXPECT_NE(e.message().find("INPUT0"), std::string::npos) << e.what();
    }
    EXPECT_THROW(req.input<int32_t>("INPUT0", {1, 4}, {1, 2, 3, 4}), infer::Error);
    EXPECT_THROW(req.input<float>("NOPE", {1, 4}, {1, 2, 3, 4}), infer::Error);
    EXPECT_THROW(req.correlation_id(std::string(INFER_MAX_CORRELATION_ID_BYTES + 1, 'x')),
                 infer::Error);
    EXPECT_THROW(req.timeout(std::chrono::milliseconds(-1)), infer::Error);
    EXPECT_THROW(req.parameter("big", UINT64_MAX), infer::Error);
    // The request is still usable after refused setters.
    req.input<float>("INPUT0", {1, 4}, {1, 2, 3, 4}).input<float>("INPUT1", {1, 4}, {1, 1, 1, 1});
    EXPECT_TRUE(server.infer(std::move(req)).get().ok());
}

TEST(Server, OptionsAndModelManagement) {
    infer::ServerOptions opts;
    opts.gpu(infer::GpuMode::Off).explicit_model_control();
    infer::Server server(opts);
    EXPECT_FALSE(server.model_ready("m"));
    server.load_model("m", support::add_sub_config("TYPE_INT32", 2));
    EXPECT_TRUE(server.model_ready("m"));
    const std::string config = server.model_config_json("m");
    EXPECT_NE(config.find("add_sub"), std::string::npos) << config;
    EXPECT_NE(config.find("INPUT0"), std::string::npos) << config;
    EXPECT_NE(server.statistics_json().find("\"models\""), std::string::npos);
    EXPECT_NE(server.statistics_json("m").find("\"inference_count\""), std::string::npos);
    server.unload_model("m");
    EXPECT_TRUE(support::wait_until([&] { return !server.model_ready("m"); }));
    EXPECT_THROW(server.model_config_json("m"), infer::Error);
}

TEST(Server, StartupModelsFromTheRepository) {
    infer::Server server(infer::ServerOptions()
                             .model_repository(support::repo_dir() + "/models")
                             .explicit_model_control()
                             .startup_model("add_sub"));
    EXPECT_TRUE(server.model_ready("add_sub"));
    EXPECT_FALSE(server.model_ready("mlp"));
    server.load_model("mlp"); // read from the repository
    EXPECT_TRUE(server.model_ready("mlp"));
    try {
        infer::Server bad(infer::ServerOptions()
                              .model_repository(support::repo_dir() + "/models")
                              .explicit_model_control()
                              .startup_model("not_in_the_repository"));
        FAIL() << "a missing startup model was accepted";
    } catch (const infer::Error &e) {
        EXPECT_NE(e.message().find("not_in_the_repository"), std::string::npos) << e.what();
    }
}

TEST(Server, RateLimiterOptions) {
    infer::Server server(infer::ServerOptions().rate_limit(true).rate_limit_resource("R", 1));
    const std::string cfg =
        "backend: \"identity\" max_batch_size: 0\n"
        "input [ { name: \"IN\" data_type: TYPE_INT32 dims: [ 1 ] } ]\n"
        "output [ { name: \"OUT\" data_type: TYPE_INT32 dims: [ 1 ] } ]\n"
        "instance_group [ { count: 1 kind: KIND_CPU rate_limiter { resources [ { name: \"R\" "
        "global: true count: COUNT } ] } } ]\n";
    auto with = [&](const char *count) {
        std::string c = cfg;
        c.replace(c.find("COUNT"), 5, count);
        return c;
    };
    server.load_model("fits", with("1"));
    EXPECT_TRUE(server.model_ready("fits"));
    try {
        server.load_model("too_big", with("2"));
        FAIL() << "an instance needing more than the server gives was loaded";
    } catch (const infer::Error &e) {
        EXPECT_EQ(e.code(), INFER_STATUS_INVALID_ARGUMENT);
        EXPECT_NE(e.message().find("needs 2, but the server gives it 1"), std::string::npos)
            << e.what();
    }
}

TEST(Server, RepositoryIndexAndModelFilesInMemory) {
    infer::Server server(infer::ServerOptions()
                             .model_repository(support::repo_dir() + "/models")
                             .explicit_model_control()
                             .startup_model("add_sub"));
    std::string index = server.repository_index_json();
    EXPECT_NE(index.find(R"({"name":"add_sub","version":"1","state":"READY","reason":""})"),
              std::string::npos)
        << index;
    EXPECT_NE(index.find(R"({"name":"mlp","state":"UNAVAILABLE","reason":"not loaded"})"),
              std::string::npos)
        << index;
    // Explicit model control: the application loads, the repository is not polled.
    try {
        server.poll_repository();
        FAIL() << "a poll under explicit model control was accepted";
    } catch (const infer::Error &e) {
        EXPECT_EQ(e.code(), INFER_STATUS_UNAVAILABLE);
        EXPECT_NE(e.message().find("explicit model control"), std::string::npos) << e.what();
    }
    std::ifstream f(support::repo_dir() + "/models/add_sub/1/model.onnx", std::ios::binary);
    const std::string onnx((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    ASSERT_GT(onnx.size(), 0u);
    server.load_model_files("mem",
                            "name: \"mem\" platform: \"onnxruntime_onnx\" max_batch_size: 8",
                            {{"file:1/model.onnx", onnx}});
    EXPECT_TRUE(server.model_ready("mem"));
    index = server.repository_index_json(true);
    EXPECT_NE(index.find(R"("name":"mem")"), std::string::npos) << index;
    EXPECT_EQ(index.find(R"("name":"mlp")"), std::string::npos) << index;
    EXPECT_THROW(server.load_model_files("bad", "backend: \"add_sub\"", {{"../x", onnx}}),
                 infer::Error);
}

TEST(Server, MetricsAndShutdown) {
    infer::Server server;
    server.load_model("add_sub", support::add_sub_config());
    infer::Response r = server
                            .infer(server.request("add_sub")
                                       .input<float>("INPUT0", {1, 4}, {1, 2, 3, 4})
                                       .input<float>("INPUT1", {1, 4}, {4, 3, 2, 1}))
                            .get();
    ASSERT_TRUE(r.ok()) << r.error_message();
    const std::string metrics = server.metrics_prometheus();
    EXPECT_NE(metrics.find("infer_request_success_total"), std::string::npos) << metrics;
    server.shutdown(std::chrono::milliseconds(1000));
    server.shutdown(); // idempotent
    try {
        (void)server.infer(server.request("add_sub")
                               .input<float>("INPUT0", {1, 4}, {1, 2, 3, 4})
                               .input<float>("INPUT1", {1, 4}, {4, 3, 2, 1}));
        FAIL() << "a request was accepted after shutdown";
    } catch (const infer::Error &e) {
        // The model may be gone (NOT_FOUND at request_new) or refuse (UNAVAILABLE).
        EXPECT_TRUE(e.code() == INFER_STATUS_UNAVAILABLE || e.code() == INFER_STATUS_NOT_FOUND)
            << e.what();
    }
}

TEST(Server, LogCallbackReceivesMessages) {
    std::atomic<int> infos{0};
    std::atomic<int> loaded{0};
    {
        infer::ServerOptions opts;
        opts.log_callback(
            [&](infer::LogLevel level, std::string_view message) {
                if (level == infer::LogLevel::Info) {
                    infos++;
                }
                if (message.find("model 'm' loaded") != std::string_view::npos) {
                    loaded++;
                }
                throw std::runtime_error("a log callback that throws is harmless");
            },
            infer::LogLevel::Info);
        infer::Server server(opts);
        { infer::ServerOptions gone = std::move(opts); } // the server keeps the functor
        server.load_model("m", support::add_sub_config());
    }
    EXPECT_GE(infos.load(), 1);
    EXPECT_EQ(loaded.load(), 1);
}
