// A custom backend written in C++ through infer::Backend: "normalize" scales each row of
// 8 floats to unit length and returns its length. The library does the queueing and
// dynamic batching over 2 instances; the backend only computes, and fails single rows
// (an all-zero vector) with Batch::set_row_error. Requests come through the callback
// API; every answer is checked and the program exits non-zero on any wrong result.
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <infer/infer.hpp>

namespace {

constexpr int kDims = 8;
constexpr int kRequests = 600;

const char *CONFIG = R"(
  backend: "normalize"
  max_batch_size: 16
  input [ { name: "X" data_type: TYPE_FP32 dims: [ 8 ] } ]
  output [ { name: "UNIT" data_type: TYPE_FP32 dims: [ 8 ] },
           { name: "NORM" data_type: TYPE_FP32 dims: [ 1 ] } ]
  instance_group [ { count: 2 kind: KIND_CPU } ]
  dynamic_batching { max_queue_delay_microseconds: 500 }
)";

/// One instance: computes a batch of rows.
class NormalizeInstance : public infer::Instance {
public:
    explicit NormalizeInstance(uint32_t index) : index_(index) {}

    void execute(infer::Batch &batch) override {
        const infer::TensorView<const float> x = batch.input<float>("X");
        const int64_t rows = x.shape().at(0);
        infer::TensorView<float> unit = batch.output<float>("UNIT", x.shape());
        infer::TensorView<float> norm = batch.output<float>("NORM", {rows, 1});
        for (int64_t r = 0; r < rows; r++) {
            const auto row = static_cast<std::size_t>(r);
            double sq = 0;
            for (std::size_t k = 0; k < kDims; k++) {
                sq += static_cast<double>(x[row * kDims + k]) * x[row * kDims + k];
            }
            if (sq == 0) {
                // Fails only the request holding this row.
                batch.set_row_error(static_cast<uint32_t>(r), INFER_STATUS_INVALID_ARGUMENT,
                                    "instance " + std::to_string(index_) +
                                        ": a zero vector has no direction");
                continue;
            }
            const double len = std::sqrt(sq);
            norm[row] = static_cast<float>(len);
            for (std::size_t k = 0; k < kDims; k++) {
                unit[row * kDims + k] = static_cast<float>(x[row * kDims + k] / len);
            }
        }
    }

private:
    uint32_t index_;
};

class Normalize : public infer::Backend {
public:
    std::unique_ptr<infer::Instance> create_instance(const infer::InstanceInfo &info) override {
        std::printf("normalize: instance %u of model '%s'\n", info.instance_index,
                    info.model_name.c_str());
        instances++;
        return std::make_unique<NormalizeInstance>(info.instance_index);
    }
    std::atomic<int> instances{0};
};

std::vector<float> input_of(int i) {
    std::vector<float> x(kDims, 0.0f);
    if (i % 50 == 49) {
        return x; // every 50th request is a zero vector, answered with an error
    }
    for (int k = 0; k < kDims; k++) {
        x[static_cast<std::size_t>(k)] = static_cast<float>((i + k) % 5) - 1.5f;
    }
    return x;
}

/// Whether a response is what input_of(i) should give.
bool correct(const infer::Response &r, int i) {
    const std::vector<float> x = input_of(i);
    double sq = 0;
    for (float v : x) {
        sq += static_cast<double>(v) * v;
    }
    if (sq == 0) {
        return r.status() == INFER_STATUS_INVALID_ARGUMENT &&
               r.error_message().find("zero vector") != std::string::npos;
    }
    if (!r.ok()) {
        std::fprintf(stderr, "request %d failed: %s\n", i, r.error_message().c_str());
        return false;
    }
    const double len = std::sqrt(sq);
    const auto unit = r.output<float>("UNIT");
    const auto norm = r.output<float>("NORM");
    if (unit.size() != static_cast<std::size_t>(kDims) || norm.size() != 1 ||
        std::fabs(norm[0] - len) > 1e-5) {
        return false;
    }
    for (std::size_t k = 0; k < unit.size(); k++) {
        if (std::fabs(unit[k] - x[k] / len) > 1e-6) {
            return false;
        }
    }
    return true;
}

} // namespace

int main() try {
    // What the callbacks use is declared before the server, so it outlives the server's
    // drain at destruction.
    std::mutex mu;
    std::condition_variable cv;
    int answered = 0, wrong = 0, rejected = 0;

    auto backend = std::make_shared<Normalize>();
    infer::Server server;
    server.register_backend("normalize", backend);
    server.load_model("normalize", CONFIG);

    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < kRequests; i++) {
        server.enqueue(server.request("normalize").input("X", {1, kDims}, input_of(i)),
                       [&, i](infer::Response r, bool final) {
                           const bool ok = correct(r, i);
                           const std::lock_guard<std::mutex> lock(mu);
                           wrong += ok ? 0 : 1;
                           rejected += r.ok() ? 0 : 1;
                           if (final && ++answered == kRequests) {
                               cv.notify_one();
                           }
                       });
    }
    {
        std::unique_lock<std::mutex> lock(mu);
        if (!cv.wait_for(lock, std::chrono::seconds(30), [&] { return answered == kRequests; })) {
            std::fprintf(stderr, "only %d of %d requests answered\n", answered, kRequests);
            return 1;
        }
    }
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();

    const std::string stats = server.statistics_json("normalize");
    std::printf("statistics: %s\n", stats.c_str());
    const std::lock_guard<std::mutex> lock(mu);
    std::printf("%d requests in %.1f ms on %d instances: %d answered as expected (%d zero "
                "vectors refused), %d wrong\n",
                kRequests, ms, backend->instances.load(), answered - wrong, rejected, wrong);
    return wrong == 0 && rejected == kRequests / 50 ? 0 : 1;
} catch (const std::exception &e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
}
