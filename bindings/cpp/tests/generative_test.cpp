// A generative model through the C++ binding: the tiny GPT-2 of models/tiny_gpt2,
// streaming one token per response, the FINAL's parameters, and cancellation.
#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <infer/infer.hpp>

#include "support.hpp"

using namespace std::chrono_literals;

namespace {

infer::Server gpt2_server() {
    return infer::Server(infer::ServerOptions()
                             .model_repository(support::repo_dir() + "/models")
                             .explicit_model_control()
                             .startup_model("tiny_gpt2")
                             .gpu(infer::GpuMode::Off));
}

infer::Request gpt2_request(infer::Server &server, std::vector<int32_t> prompt,
                            int64_t max_tokens, bool streaming) {
    const int64_t n = static_cast<int64_t>(prompt.size());
    return server.request("tiny_gpt2")
        .input<int32_t>("input_ids", {n}, std::move(prompt))
        .parameter("max_tokens", max_tokens)
        .parameter("streaming", streaming);
}

/// What the responses of one streaming request brought, filled on a library thread.
struct Stream {
    std::mutex mu;
    std::condition_variable changed;
    std::vector<std::size_t> tokens_per_response;
    std::vector<int32_t> tokens;
    std::optional<infer::Response> final; // kept to read its status and parameters
    /// What server.cancel returned when the receiver sent it (receiver's cancel_at).
    std::optional<bool> cancelled;

    /// The response callback for enqueue. With a server and cancel_at, the callback that
    /// brings the tokens to cancel_at cancels the request (by the response's id).
    auto receiver(infer::Server *server = nullptr, std::size_t cancel_at = 0) {
        return [this, server, cancel_at](infer::Response r, bool is_final) {
            const std::lock_guard<std::mutex> lock(mu);
            if (r.ok()) { // outputs of a non-OK response throw; a cancelled FINAL has no token
                const auto ids = r.output<int32_t>("output_ids");
                tokens_per_response.push_back(ids.size());
                const std::size_t before = tokens.size();
                tokens.insert(tokens.end(), ids.begin(), ids.end());
                if (server != nullptr && !is_final && before < cancel_at &&
                    tokens.size() >= cancel_at) {
                    cancelled = server->cancel(r.request_id());
                }
            }
            if (is_final) {
                final.emplace(std::move(r));
            }
            changed.notify_all();
        };
    }

    /// Waits until `done()` holds (under the lock) or 30 s passed.
    template <class F>
    bool wait(F done) {
        std::unique_lock<std::mutex> lock(mu);
        return changed.wait_for(lock, 30s, done);
    }
};

} // namespace

TEST(Generative, StreamingSendsOneTokenPerResponse) {
    infer::Server server = gpt2_server();
    Stream s;
    server.enqueue(gpt2_request(server, {'H', 'e', 'l', 'l', 'o'}, 12, true), s.receiver());
    ASSERT_TRUE(s.wait([&] { return s.final.has_value(); }));

    EXPECT_EQ(s.tokens_per_response, std::vector<std::size_t>(12, 1));
    ASSERT_TRUE(s.final->ok()) << s.final->error_message();
    EXPECT_EQ(s.final->parameter_string("finish_reason"), "length");
    EXPECT_EQ(s.final->parameter_int("prompt_tokens"), 5);
    EXPECT_EQ(s.final->parameter_int("generated_tokens"), 12);
    EXPECT_TRUE(s.final->parameter_int("cached_tokens").has_value());

    // Not streamed: one response with the same greedy tokens.
    infer::Response all =
        server.infer(gpt2_request(server, {'H', 'e', 'l', 'l', 'o'}, 12, false)).get();
    ASSERT_TRUE(all.ok()) << all.error_message();
    const auto ids = all.output<int32_t>("output_ids");
    EXPECT_EQ(std::vector<int32_t>(ids.begin(), ids.end()), s.tokens);
    EXPECT_EQ(all.parameter_string("finish_reason"), "length");
}

TEST(Generative, CancelStopsARunningRequestAfterTheCurrentIteration) {
    infer::Server server = gpt2_server();
    Stream running, other;
    server.enqueue(gpt2_request(server, {8, 9}, 20, true), other.receiver());
    // The callback of the fifth token cancels: callbacks run on the model's loop between
    // iterations, so the request is still running then, however fast the model is (a
    // thread that waits for five tokens and then cancels may find all 100 made).
    const uint64_t id = server.enqueue(gpt2_request(server, {5, 6, 7}, 100, true),
                                       running.receiver(&server, 5));
    ASSERT_TRUE(running.wait([&] { return running.final.has_value(); }));
    EXPECT_EQ(running.cancelled, std::optional<bool>(true));

    EXPECT_EQ(running.final->status(), INFER_STATUS_CANCELLED);
    EXPECT_EQ(running.final->parameter_string("finish_reason"), "cancelled");
    EXPECT_GE(running.tokens.size(), 5u);
    EXPECT_LT(running.tokens.size(), 100u);
    EXPECT_FALSE(server.cancel(id)) << "a finished request is not found";

    // The other request of the batch runs to its end.
    ASSERT_TRUE(other.wait([&] { return other.final.has_value(); }));
    EXPECT_TRUE(other.final->ok()) << other.final->error_message();
    EXPECT_EQ(other.final->parameter_string("finish_reason"), "length");
    EXPECT_EQ(other.tokens.size(), 20u);
}

TEST(Generative, IterationStatisticsCallback) {
    infer::Server server = gpt2_server();
    std::mutex mu;
    std::vector<std::string> seen;
    server.set_iteration_stats_callback("tiny_gpt2", [&](std::string_view json) {
        const std::lock_guard<std::mutex> lock(mu);
        seen.emplace_back(json);
    });
    infer::Response r = server.infer(gpt2_request(server, {1, 2, 3}, 5, false)).get();
    ASSERT_TRUE(r.ok()) << r.error_message();
    {
        const std::lock_guard<std::mutex> lock(mu);
        ASSERT_EQ(seen.size(), 5u); // one per iteration: the prompt, then 4 decodes
        EXPECT_NE(seen[0].find("\"context_tokens\":3"), std::string::npos) << seen[0];
        EXPECT_NE(seen[0].find("\"kv_blocks_used\""), std::string::npos) << seen[0];
    }
    server.set_iteration_stats_callback("tiny_gpt2", nullptr);
    (void)server.infer(gpt2_request(server, {4}, 3, false)).get();
    {
        const std::lock_guard<std::mutex> lock(mu);
        EXPECT_EQ(seen.size(), 5u) << "cleared: no more calls";
    }
    try {
        server.set_iteration_stats_callback("nope", [](std::string_view) {});
        FAIL() << "an unknown model is refused";
    } catch (const infer::Error &e) {
        EXPECT_EQ(e.code(), INFER_STATUS_NOT_FOUND) << e.what();
    }
}
