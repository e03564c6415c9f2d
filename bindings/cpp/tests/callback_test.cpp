// The callback API: sequences driven from callbacks, functor lifetime, and exceptions
// thrown by callbacks.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <future>
#include <functional>
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

/// Counts how many of its copies are destroyed, to check that the binding frees every
/// callback functor exactly once.
struct Tracked {
    explicit Tracked(std::shared_ptr<std::atomic<int>> d) : destroyed(std::move(d)) {}
    Tracked(Tracked &&other) noexcept : destroyed(std::move(other.destroyed)) {}
    Tracked(const Tracked &) = delete;
    ~Tracked() {
        if (destroyed) {
            (*destroyed)++;
        }
    }
    std::shared_ptr<std::atomic<int>> destroyed;
};

infer::Request add_sub_request(infer::Server &server) {
    return server.request("add_sub")
        .input<float>("INPUT0", {1, 4}, {1, 2, 3, 4})
        .input<float>("INPUT1", {1, 4}, {1, 1, 1, 1});
}

} // namespace

TEST(Callbacks, SequencesOfTheAccumulatorDrivenFromCallbacks) {
    infer::Server server;
    // 2 instances x 2 slots, 6 streams: two wait in the backlog.
    server.load_model("running_sum", support::accumulator_config(2, 2));
    constexpr int streams = 6, readings = 10;
    struct Stream {
        int sent = 0;
        int64_t expected = 0;
        std::vector<int64_t> sums;
        std::string error;
    };
    std::vector<Stream> state(streams);
    std::mutex mu;
    std::atomic<int> done{0};

    std::function<void(int)> send_next = [&](int s) {
        Stream &st = state[static_cast<std::size_t>(s)];
        const int64_t value = (s + 1) * 100 + st.sent;
        infer::Request req = server.request("running_sum");
        // Half the streams use numeric IDs, half string IDs.
        if (s % 2 == 0) {
            req.correlation_id(static_cast<uint64_t>(s + 1));
        } else {
            req.correlation_id("stream-" + std::to_string(s));
        }
        req.sequence_start(st.sent == 0)
            .sequence_end(st.sent == readings - 1)
            .input<int64_t>("INPUT", {1, 1}, {value});
        st.expected += value;
        st.sent++;
        server.enqueue(std::move(req), [&, s](infer::Response r, bool final) {
            Stream &me = state[static_cast<std::size_t>(s)];
            {
                const std::lock_guard<std::mutex> lock(mu);
                if (!r.ok()) {
                    me.error = r.error_message();
                } else {
                    me.sums.push_back(r.output<int64_t>("OUTPUT")[0]);
                }
            }
            if (!final) {
                return;
            }
            if (me.error.empty() && me.sent < readings) {
                send_next(s); // a callback may enqueue the next step
            } else {
                done++;
            }
        });
    };
    for (int s = 0; s < streams; s++) {
        send_next(s);
    }
    ASSERT_TRUE(support::wait_until([&] { return done.load() == streams; }));
    const std::lock_guard<std::mutex> lock(mu);
    for (int s = 0; s < streams; s++) {
        const Stream &st = state[static_cast<std::size_t>(s)];
        EXPECT_EQ(st.error, "") << "stream " << s;
        ASSERT_EQ(st.sums.size(), static_cast<std::size_t>(readings)) << "stream " << s;
        int64_t sum = 0;
        for (int i = 0; i < readings; i++) {
            sum += (s + 1) * 100 + i;
            EXPECT_EQ(st.sums[static_cast<std::size_t>(i)], sum) << "stream " << s << " step " << i;
        }
    }
}

TEST(Callbacks, FunctorIsDestroyedOnceAfterTheFinalResponse) {
    infer::Server server;
    server.load_model("add_sub", support::add_sub_config());
    auto destroyed = std::make_shared<std::atomic<int>>(0);
    std::atomic<int> calls{0}, finals{0};
    constexpr int n = 20;
    for (int i = 0; i < n; i++) {
        // A move-only functor: std::function could not hold it.
        server.enqueue(add_sub_request(server),
                       [t = Tracked(destroyed), &calls, &finals](infer::Response r, bool final) {
                           calls++;
                           if (final && r.ok()) {
                               finals++;
                           }
                       });
    }
    ASSERT_TRUE(support::wait_until([&] { return destroyed->load() == n; }));
    EXPECT_EQ(calls.load(), n);
    EXPECT_EQ(finals.load(), n);
}

TEST(Callbacks, RefusedEnqueueDestroysTheFunctorAtOnce) {
    infer::Server server;
    server.load_model("add_sub", support::add_sub_config("TYPE_FP32", 4,
                                                         "dynamic_batching { default_queue_policy { "
                                                         "max_queue_size: 1 } }"));
    server.pause_model("add_sub");
    auto destroyed = std::make_shared<std::atomic<int>>(0);
    std::atomic<int> calls{0};
    server.enqueue(add_sub_request(server),
                   [t = Tracked(destroyed), &calls](infer::Response, bool) { calls++; });
    try {
        server.enqueue(add_sub_request(server),
                       [t = Tracked(destroyed), &calls](infer::Response, bool) { calls++; });
        FAIL() << "a full queue accepted a request";
    } catch (const infer::Error &e) {
        EXPECT_EQ(e.code(), INFER_STATUS_RESOURCE_EXHAUSTED);
        EXPECT_NE(e.message().find("add_sub"), std::string::npos) << e.what();
    }
    EXPECT_EQ(destroyed->load(), 1); // the refused one, without a call
    EXPECT_EQ(calls.load(), 0);
    server.resume_model("add_sub");
    ASSERT_TRUE(support::wait_until([&] { return destroyed->load() == 2; }));
    EXPECT_EQ(calls.load(), 1);
}

TEST(Callbacks, ExceptionsAreCaughtAndReported) {
    infer::Server server;
    server.load_model("add_sub", support::add_sub_config());
    std::mutex mu;
    std::vector<std::string> reported;
    server.set_exception_handler([&](std::exception_ptr e) {
        try {
            std::rethrow_exception(e);
        } catch (const std::exception &x) {
            const std::lock_guard<std::mutex> lock(mu);
            reported.push_back(x.what());
        } catch (int v) {
            const std::lock_guard<std::mutex> lock(mu);
            reported.push_back("int " + std::to_string(v));
        }
        throw std::logic_error("a handler that throws is harmless too");
    });
    auto destroyed = std::make_shared<std::atomic<int>>(0);
    server.enqueue(add_sub_request(server), [t = Tracked(destroyed)](infer::Response, bool) {
        throw std::runtime_error("callback failed");
    });
    server.enqueue(add_sub_request(server),
                   [t = Tracked(destroyed)](infer::Response) { throw 42; });
    // A failing callback does not stop the server: a later request still works.
    ASSERT_TRUE(support::wait_until([&] { return destroyed->load() == 2; }));
    EXPECT_EQ(server.callback_exception_count(), 2u);
    {
        const std::lock_guard<std::mutex> lock(mu);
        ASSERT_EQ(reported.size(), 2u);
        std::sort(reported.begin(), reported.end());
        EXPECT_EQ(reported[0], "callback failed");
        EXPECT_EQ(reported[1], "int 42");
    }
    EXPECT_TRUE(server.infer(add_sub_request(server)).get().ok());

    // Without a handler the exception is printed to stderr and dropped.
    server.set_exception_handler(nullptr);
    testing::internal::CaptureStderr();
    server.enqueue(add_sub_request(server), [t = Tracked(destroyed)](infer::Response, bool) {
        throw std::runtime_error("printed, not lost");
    });
    ASSERT_TRUE(support::wait_until([&] { return destroyed->load() == 3; }));
    const std::string err = testing::internal::GetCapturedStderr();
    EXPECT_NE(err.find("printed, not lost"), std::string::npos) << err;
    EXPECT_EQ(server.callback_exception_count(), 3u);
}

TEST(Callbacks, EveryRequestGetsOneFinalAtShutdown) {
    std::atomic<int> calls{0}, finals{0}, answered{0};
    constexpr int n = 10;
    {
        infer::Server server;
        server.load_model("add_sub",
                          support::add_sub_config("TYPE_FP32", 4, "dynamic_batching { }"));
        server.pause_model("add_sub");
        for (int i = 0; i < n; i++) {
            server.enqueue(add_sub_request(server), [&](infer::Response r, bool final) {
                calls++;
                if (final) {
                    finals++;
                }
                // Drained (OK) or cancelled when the drain times out: never lost.
                if (r.ok() || r.status() == INFER_STATUS_CANCELLED) {
                    answered++;
                }
            });
        }
        server.shutdown(std::chrono::milliseconds(50));
        EXPECT_EQ(finals.load(), n); // shutdown returns after every FINAL
        EXPECT_THROW(server.enqueue(add_sub_request(server), [](infer::Response) {}), infer::Error);
    }
    EXPECT_EQ(calls.load(), n);
    EXPECT_EQ(finals.load(), n);
    EXPECT_EQ(answered.load(), n);
}

TEST(Callbacks, DestroyingTheServerWaitsForCallbacks) {
    std::atomic<int> finals{0};
    std::vector<std::future<infer::Response>> futures;
    {
        infer::Server server;
        server.load_model("add_sub",
                          support::add_sub_config("TYPE_FP32", 4,
                                                  "parameters { key: \"execute_delay_us\" value { "
                                                  "string_value: \"2000\" } }"));
        for (int i = 0; i < 5; i++) {
            server.enqueue(add_sub_request(server), [&](infer::Response, bool final) {
                if (final) {
                    std::this_thread::sleep_for(1ms);
                    finals++;
                }
            });
            futures.push_back(server.infer(add_sub_request(server)));
        }
    }
    EXPECT_EQ(finals.load(), 5);
    for (auto &f : futures) {
        EXPECT_EQ(f.wait_for(0s), std::future_status::ready);
        EXPECT_TRUE(f.get().ok());
    }
}
