// Many client threads, one server, dynamic batching, with the C++ binding's futures:
// 8 threads each send 400 requests to the built-in add_sub model, keeping up to 4 in
// flight, and check every answer. The library groups concurrent requests into batches;
// the program prints the throughput and the batch-size histogram from the statistics
// JSON, and exits non-zero on any wrong or missing result.
#include <atomic>
#include <chrono>
#include <cstdio>
#include <deque>
#include <exception>
#include <future>
#include <regex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <infer/infer.hpp>

namespace {

constexpr int kThreads = 8;
constexpr int kPerThread = 400;
constexpr std::size_t kWindow = 4; // requests in flight per thread
constexpr int kDims = 16;

const char *CONFIG = R"(
  backend: "add_sub"
  max_batch_size: 32
  input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 16 ] },
          { name: "INPUT1" data_type: TYPE_FP32 dims: [ 16 ] } ]
  output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 16 ] },
           { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 16 ] } ]
  dynamic_batching { max_queue_delay_microseconds: 300 preferred_batch_size: [ 16, 32 ] }
  parameters { key: "execute_delay_us" value { string_value: "500" } }
)";

struct Pending {
    int index;
    std::future<infer::Response> response;
};

float a_of(int i, int k) { return static_cast<float>(i % 1000) + 0.5f * static_cast<float>(k); }
float b_of(int i, int k) { return static_cast<float>(k) - static_cast<float>(i % 7); }

/// Checks one answer: OUTPUT0 = a + b, OUTPUT1 = a - b, shape [1, 16].
bool correct(const infer::Response &r, int i) {
    if (!r.ok()) {
        std::fprintf(stderr, "request %d failed: %s\n", i, r.error_message().c_str());
        return false;
    }
    const infer::TensorView<const float> sum = r.output<float>("OUTPUT0");
    const infer::TensorView<const float> diff = r.output<float>("OUTPUT1");
    if (sum.shape() != infer::Shape{1, kDims} || diff.size() != static_cast<std::size_t>(kDims)) {
        return false;
    }
    for (int k = 0; k < kDims; k++) {
        const auto at = static_cast<std::size_t>(k);
        if (sum[at] != a_of(i, k) + b_of(i, k) || diff[at] != a_of(i, k) - b_of(i, k)) {
            return false;
        }
    }
    return true;
}

void client(infer::Server &server, int thread, std::atomic<int> &good, std::atomic<int> &bad) {
    std::deque<Pending> in_flight;
    auto settle_oldest = [&] {
        Pending p = std::move(in_flight.front());
        in_flight.pop_front();
        (correct(p.response.get(), p.index) ? good : bad)++;
    };
    for (int n = 0; n < kPerThread; n++) {
        const int i = thread * kPerThread + n;
        std::vector<float> a(kDims), b(kDims);
        for (int k = 0; k < kDims; k++) {
            a[static_cast<std::size_t>(k)] = a_of(i, k);
            b[static_cast<std::size_t>(k)] = b_of(i, k);
        }
        try {
            in_flight.push_back({i, server.infer(server.request("add_sub")
                                                     .input("INPUT0", {1, kDims}, a)
                                                     .input("INPUT1", {1, kDims}, b))});
        } catch (const infer::Error &e) {
            std::fprintf(stderr, "request %d not sent: %s\n", i, e.what());
            bad++;
        }
        if (in_flight.size() >= kWindow) {
            settle_oldest();
        }
    }
    while (!in_flight.empty()) {
        settle_oldest();
    }
}

/// Prints the "batch_sizes" array of the statistics JSON as a histogram.
void print_histogram(const std::string &json) {
    const std::regex entry(R"re(\{"size":(\d+),"count":(\d+)\})re");
    const auto from = json.find("\"batch_sizes\":[");
    if (from == std::string::npos) {
        return;
    }
    const std::string list = json.substr(from, json.find(']', from) - from);
    std::vector<std::pair<long, long>> rows;
    long most = 1;
    for (std::sregex_iterator it(list.begin(), list.end(), entry), end; it != end; ++it) {
        rows.emplace_back(std::stol((*it)[1]), std::stol((*it)[2]));
        most = std::max(most, rows.back().second);
    }
    std::printf("batch size histogram (executions per batch size):\n");
    for (const auto &[size, count] : rows) {
        const int bar = static_cast<int>((count * 50 + most - 1) / most);
        std::printf("  %3ld | %-50s %ld\n", size, std::string(static_cast<std::size_t>(bar), '#').c_str(),
                    count);
    }
}

} // namespace

int main() try {
    infer::Server server(infer::ServerOptions().gpu(infer::GpuMode::Off));
    server.load_model("add_sub", CONFIG);

    std::atomic<int> good{0}, bad{0};
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; t++) {
        threads.emplace_back(client, std::ref(server), t, std::ref(good), std::ref(bad));
    }
    for (auto &th : threads) {
        th.join();
    }
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

    constexpr int total = kThreads * kPerThread;
    std::printf("%d requests from %d threads in %.3f s: %.0f requests/s\n", total, kThreads,
                seconds, total / seconds);
    const std::string stats = server.statistics_json("add_sub");
    std::printf("statistics: %s\n", stats.c_str());
    print_histogram(stats);
    std::printf("%d correct, %d wrong or missing\n", good.load(), total - good.load());
    return good.load() == total && bad.load() == 0 ? 0 : 1;
} catch (const std::exception &e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
}
