// The shipped ONNX model repository (models/) through the C++ binding, checked against
// the onnxruntime reference data in tests/fixtures/models/.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <future>
#include <mutex>
#include <string>
#include <vector>

#include <infer/infer.hpp>

#include "support.hpp"

using namespace std::chrono_literals;

namespace {

infer::Server repository_server() {
    return infer::Server(infer::ServerOptions()
                             .model_repository(support::repo_dir() + "/models")
                             .explicit_model_control()
                             .startup_model("add_sub")
                             .startup_model("mlp")
                             .startup_model("accumulator_onnx")
                             .gpu(infer::GpuMode::Off));
}

std::vector<float> as_floats(const std::vector<double> &v) {
    return std::vector<float>(v.begin(), v.end());
}

void expect_near(const infer::TensorView<const float> &got, const std::vector<double> &want,
                 double tolerance) {
    ASSERT_EQ(got.size(), want.size());
    for (std::size_t i = 0; i < want.size(); i++) {
        EXPECT_NEAR(got[i], want[i], tolerance) << "element " << i << " of " << got.name();
    }
}

} // namespace

TEST(Onnx, AddSubMatchesTheReference) {
    infer::Server server = repository_server();
    // Case 1 of the reference: a batch of 3 rows of 16.
    const auto arrays = support::fixture_arrays("add_sub");
    ASSERT_GE(arrays.size(), 8u);
    const auto &in0 = arrays[4], &in1 = arrays[5], &out0 = arrays[6], &out1 = arrays[7];
    ASSERT_EQ(in0.size(), 48u);
    infer::Response r = server
                            .infer(server.request("add_sub")
                                       .input("INPUT0", {3, 16}, as_floats(in0))
                                       .input("INPUT1", {3, 16}, as_floats(in1)))
                            .get();
    ASSERT_TRUE(r.ok()) << r.error_message();
    EXPECT_EQ(r.output<float>("OUTPUT0").shape(), (infer::Shape{3, 16}));
    expect_near(r.output<float>("OUTPUT0"), out0, 1e-5);
    expect_near(r.output<float>("OUTPUT1"), out1, 1e-5);
}

TEST(Onnx, MlpRowsBatchedDynamicallyMatchTheReference) {
    infer::Server server = repository_server();
    EXPECT_NE(server.model_config_json("mlp").find("FEATURES"), std::string::npos);
    // Case 1: 3 rows of 64 features -> 3 x 10 logits. Sent as one request, then as three
    // concurrent one-row requests that the dynamic batcher may group.
    const auto arrays = support::fixture_arrays("mlp");
    ASSERT_GE(arrays.size(), 4u);
    const std::vector<float> features = as_floats(arrays[2]);
    const std::vector<double> &logits = arrays[3];
    ASSERT_EQ(features.size(), 3u * 64u);
    ASSERT_EQ(logits.size(), 3u * 10u);

    infer::Response whole =
        server.infer(server.request("mlp").input("FEATURES", {3, 64}, features)).get();
    ASSERT_TRUE(whole.ok()) << whole.error_message();
    EXPECT_EQ(whole.output<float>("LOGITS").shape(), (infer::Shape{3, 10}));
    expect_near(whole.output<float>("LOGITS"), logits, 1e-4);

    std::vector<std::future<infer::Response>> rows;
    for (std::size_t row = 0; row < 3; row++) {
        rows.push_back(server.infer(server.request("mlp").input<float>(
            "FEATURES", {1, 64}, features.data() + row * 64, 64)));
    }
    for (std::size_t row = 0; row < 3; row++) {
        infer::Response r = rows[row].get();
        ASSERT_TRUE(r.ok()) << r.error_message();
        const std::vector<double> want(logits.begin() + static_cast<std::ptrdiff_t>(row * 10),
                                       logits.begin() + static_cast<std::ptrdiff_t>(row * 10 + 10));
        expect_near(r.output<float>("LOGITS"), want, 1e-4);
    }
    // Inferences are rows, as in Triton: 3 in the whole request and 1 in each of the 3
    // others; 4 requests succeeded.
    const std::string stats = server.statistics_json("mlp");
    EXPECT_NE(stats.find("\"inference_count\":6"), std::string::npos) << stats;
    EXPECT_NE(stats.find("\"success_count\":4"), std::string::npos) << stats;
}

TEST(Onnx, AccumulatorSequenceThroughCallbacks) {
    infer::Server server = repository_server();
    // The first reference sequence (correlation ID 1001), each step sent from the
    // previous step's callback.
    const auto arrays = support::fixture_arrays("accumulator_onnx");
    constexpr std::size_t steps = 7;
    ASSERT_GE(arrays.size(), 2 * steps);
    std::vector<float> inputs, expected;
    for (std::size_t i = 0; i < steps; i++) {
        inputs.push_back(static_cast<float>(arrays[2 * i][0]));
        expected.push_back(static_cast<float>(arrays[2 * i + 1][0]));
    }

    std::mutex mu;
    std::vector<float> got;
    std::vector<std::string> errors;
    std::promise<void> finished;
    std::function<void(std::size_t)> send = [&](std::size_t i) {
        infer::Request req = server.request("accumulator_onnx")
                                 .correlation_id(uint64_t{1001})
                                 .sequence_start(i == 0)
                                 .sequence_end(i + 1 == steps)
                                 .input<float>("INPUT", {1, 1}, {inputs[i]});
        server.enqueue(std::move(req), [&, i](infer::Response r, bool final) {
            {
                const std::lock_guard<std::mutex> lock(mu);
                if (r.ok()) {
                    got.push_back(r.output<float>("OUTPUT")[0]);
                } else {
                    errors.push_back(r.error_message());
                }
            }
            if (!final) {
                return;
            }
            if (r.ok() && i + 1 < steps) {
                send(i + 1);
            } else {
                finished.set_value();
            }
        });
    };
    send(0);
    ASSERT_EQ(finished.get_future().wait_for(10s), std::future_status::ready);
    const std::lock_guard<std::mutex> lock(mu);
    EXPECT_TRUE(errors.empty()) << errors.front();
    ASSERT_EQ(got.size(), steps);
    for (std::size_t i = 0; i < steps; i++) {
        EXPECT_NEAR(got[i], expected[i], 1e-4) << "step " << i;
    }
}

// Where ONNX Runtime cannot be loaded, a server that requires it refuses ONNX models with
// UNAVAILABLE naming the file it tried.
TEST(Onnx, OnnxRuntimeRequiredWhereItCannotLoad) {
    if (std::getenv("INFER_ONNXRUNTIME_LIBRARY") != nullptr) {
        GTEST_SKIP() << "INFER_ONNXRUNTIME_LIBRARY is set: ONNX Runtime loads here";
    }
    infer::Server server(infer::ServerOptions()
                             .model_repository(support::repo_dir() + "/models")
                             .explicit_model_control()
                             .onnxruntime_library("/nonexistent/libonnxruntime.so.1.32.0")
                             .onnxruntime_required()
                             .onnxruntime_threads(1, 1)
                             .gpu(infer::GpuMode::Off));
    try {
        server.load_model("mlp");
        FAIL() << "mlp loaded without ONNX Runtime";
    } catch (const infer::Error &e) {
        EXPECT_EQ(e.code(), INFER_STATUS_UNAVAILABLE) << e.what();
        EXPECT_NE(e.message().find("/nonexistent/libonnxruntime.so.1.32.0"), std::string::npos)
            << e.what();
    }
}
