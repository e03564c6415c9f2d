// Future-based inference with the built-in models, the request builder, typed views and
// move semantics.
#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <memory>
#include <numeric>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include <infer/infer.hpp>

#include "support.hpp"

using namespace std::chrono_literals;

namespace {

infer::Request add_sub_request(infer::Server &server, const std::vector<float> &a,
                               const std::vector<float> &b, const std::string &model = "add_sub") {
    const int64_t n = static_cast<int64_t>(a.size());
    return server.request(model).input("INPUT0", {1, n}, a).input("INPUT1", {1, n}, b);
}

} // namespace

TEST(Infer, FutureWithBuiltinAddSub) {
    infer::Server server;
    server.load_model("add_sub", support::add_sub_config());
    std::future<infer::Response> f =
        server.infer(add_sub_request(server, {1, 2, 3, 4}, {10, 20, 30, 40}));
    ASSERT_EQ(f.wait_for(10s), std::future_status::ready);
    infer::Response r = f.get();
    ASSERT_TRUE(r.ok()) << r.error_message();
    EXPECT_EQ(r.error_message(), "");
    EXPECT_EQ(r.model_name(), "add_sub");
    EXPECT_GE(r.model_version(), 1);
    EXPECT_NE(r.request_id(), 0u);
    EXPECT_EQ(r.output_count(), 2u);
    EXPECT_EQ(r.output<float>("OUTPUT0").to_vector(), (std::vector<float>{11, 22, 33, 44}));
    EXPECT_EQ(r.output<float>("OUTPUT1").to_vector(), (std::vector<float>{-9, -18, -27, -36}));
}

TEST(Infer, ManyFuturesAtOnceAndEveryDatatype) {
    infer::Server server;
    server.load_model("i64", support::add_sub_config("TYPE_INT64", 3,
                                                     "dynamic_batching { max_queue_delay_microseconds: 500 }"));
    server.load_model("f64", support::add_sub_config("TYPE_FP64", 2));
    std::vector<std::future<infer::Response>> futures;
    for (int64_t i = 0; i < 64; i++) {
        futures.push_back(server.infer(server.request("i64")
                                           .input<int64_t>("INPUT0", {1, 3}, {i, 2 * i, 3 * i})
                                           .input<int64_t>("INPUT1", {1, 3}, {1, 1, 1})));
    }
    for (int64_t i = 0; i < 64; i++) {
        infer::Response r = futures[static_cast<std::size_t>(i)].get();
        ASSERT_TRUE(r.ok()) << r.error_message();
        EXPECT_EQ(r.output<int64_t>("OUTPUT0").to_vector(),
                  (std::vector<int64_t>{i + 1, 2 * i + 1, 3 * i + 1}));
    }
    infer::Response d = server
                            .infer(server.request("f64")
                                       .input<double>("INPUT0", {1, 2}, {0.5, 1.5})
                                       .input<double>("INPUT1", {1, 2}, {0.25, 0.25}))
                            .get();
    EXPECT_EQ(d.output<double>("OUTPUT1").to_vector(), (std::vector<double>{0.25, 1.25}));
}

TEST(Infer, BatchOfRowsInOneRequest) {
    infer::Server server;
    server.load_model("add_sub", support::add_sub_config("TYPE_INT32", 2));
    infer::Response r = server
                            .infer(server.request("add_sub")
                                       .input<int32_t>("INPUT0", {3, 2}, {1, 2, 3, 4, 5, 6})
                                       .input<int32_t>("INPUT1", {3, 2}, {1, 1, 1, 1, 1, 1}))
                            .get();
    const infer::TensorView<const int32_t> sum = r.output<int32_t>("OUTPUT0");
    EXPECT_EQ(sum.shape(), (infer::Shape{3, 2}));
    EXPECT_EQ(sum.size(), 6u);
    EXPECT_EQ(sum.to_vector(), (std::vector<int32_t>{2, 3, 4, 5, 6, 7}));
}

TEST(Infer, SyncAndRequestedOutputs) {
    infer::Server server;
    server.load_model("add_sub", support::add_sub_config());
    infer::Response r = server.infer_sync(
        add_sub_request(server, {5, 5, 5, 5}, {1, 2, 3, 4}).requested_output("OUTPUT1"));
    ASSERT_TRUE(r.ok());
    ASSERT_EQ(r.output_count(), 1u);
    EXPECT_EQ(r.output_at(0).name(), "OUTPUT1");
    EXPECT_EQ(r.output<float>("OUTPUT1").to_vector(), (std::vector<float>{4, 3, 2, 1}));
    try {
        (void)r.output("OUTPUT0");
        FAIL() << "an output that was not requested was returned";
    } catch (const infer::Error &e) {
        EXPECT_EQ(e.code(), INFER_STATUS_NOT_FOUND);
    }
}

TEST(TypedViews, ShapeSizeIterationIndex) {
    infer::Server server;
    server.load_model("add_sub", support::add_sub_config("TYPE_FP32", 4));
    infer::Response r = server.infer(add_sub_request(server, {1, 2, 3, 4}, {1, 1, 1, 1})).get();
    infer::TensorView<const float> v = r.output<float>("OUTPUT0");
    EXPECT_EQ(v.name(), "OUTPUT0");
    EXPECT_EQ(v.datatype(), infer::DataType::FP32);
    EXPECT_EQ(v.shape(), (infer::Shape{1, 4}));
    EXPECT_EQ(v.size(), 4u);
    EXPECT_EQ(v.size_bytes(), 16u);
    EXPECT_FALSE(v.empty());
    EXPECT_EQ(v[0], 2.0f);
    EXPECT_EQ(v.at(3), 5.0f);
    EXPECT_THROW((void)v.at(4), std::out_of_range);
    EXPECT_EQ(std::accumulate(v.begin(), v.end(), 0.0f), 14.0f);
    float total = 0;
    for (float x : v) {
        total += x;
    }
    EXPECT_EQ(total, 14.0f);
    EXPECT_EQ(v.data(), &v[0]);
    // The untyped tensor says the same.
    const infer::Tensor t = r.output("OUTPUT0");
    EXPECT_EQ(t.datatype(), infer::DataType::FP32);
    EXPECT_EQ(t.byte_size(), 16u);
    EXPECT_EQ(t.element_count(), 4u);
    EXPECT_STREQ(infer::to_string(t.datatype()), "FP32");
    EXPECT_EQ(infer::datatype_from_string("TYPE_INT64"), infer::DataType::Int64);
    EXPECT_EQ(infer::byte_size(infer::DataType::FP64), 8u);
}

TEST(TypedViews, DatatypeMismatchThrows) {
    infer::Server server;
    server.load_model("add_sub", support::add_sub_config());
    infer::Response r = server.infer(add_sub_request(server, {1, 2, 3, 4}, {1, 1, 1, 1})).get();
    try {
        (void)r.output<int32_t>("OUTPUT0"); // same size as FP32, still refused
        FAIL() << "an FP32 output was viewed as INT32";
    } catch (const infer::Error &e) {
        EXPECT_EQ(e.code(), INFER_STATUS_INVALID_ARGUMENT);
        EXPECT_NE(e.message().find("FP32"), std::string::npos) << e.what();
        EXPECT_NE(e.message().find("INT32"), std::string::npos) << e.what();
        EXPECT_NE(e.message().find("OUTPUT0"), std::string::npos) << e.what();
    }
    EXPECT_THROW((void)r.output<double>("OUTPUT0"), infer::Error);
    EXPECT_THROW((void)r.output("OUTPUT0").strings(), infer::Error);
}

TEST(TypedViews, WritableViewConvertsToReadOnly) {
    std::vector<int16_t> buf{1, 2, 3};
    infer::TensorView<int16_t> w(buf.data(), buf.size(), {3}, "x");
    w[1] = 7;
    infer::TensorView<const int16_t> r = w;
    EXPECT_EQ(r.to_vector(), (std::vector<int16_t>{1, 7, 3}));
    static_assert(!std::is_convertible_v<infer::TensorView<const int16_t>, infer::TensorView<int16_t>>);
    EXPECT_EQ(infer::datatype_of_v<const uint8_t>, infer::DataType::UInt8);
    EXPECT_EQ(infer::datatype_of_v<infer::fp16_t>, infer::DataType::FP16);
}

TEST(Infer, FailedResponseIsReturnedNotThrown) {
    infer::Server server;
    server.load_model("add_sub", support::add_sub_config("TYPE_FP32", 4, "dynamic_batching { }"));
    server.pause_model("add_sub");
    std::future<infer::Response> f =
        server.infer(add_sub_request(server, {1, 2, 3, 4}, {1, 1, 1, 1}).timeout(5ms));
    ASSERT_EQ(f.wait_for(10s), std::future_status::ready);
    infer::Response r = f.get();
    EXPECT_EQ(r.status(), INFER_STATUS_DEADLINE_EXCEEDED);
    EXPECT_FALSE(r.ok());
    EXPECT_FALSE(r.error_message().empty());
    EXPECT_EQ(r.output_count(), 0u);
    try {
        (void)r.output<float>("OUTPUT0");
        FAIL() << "a failed response's output was read";
    } catch (const infer::Error &e) {
        EXPECT_EQ(e.code(), INFER_STATUS_DEADLINE_EXCEEDED);
        EXPECT_EQ(e.message(), r.error_message());
    }
    EXPECT_THROW(r.throw_if_error(), infer::Error);
    server.resume_model("add_sub");
}

TEST(Infer, CancelAQueuedRequest) {
    infer::Server server;
    server.load_model("add_sub", support::add_sub_config("TYPE_FP32", 4, "dynamic_batching { }"));
    server.pause_model("add_sub");
    std::promise<infer::Response> done;
    const uint64_t id = server.enqueue(add_sub_request(server, {1, 2, 3, 4}, {1, 1, 1, 1}),
                                       [&](infer::Response r, bool final) {
                                           if (final) {
                                               done.set_value(std::move(r));
                                           }
                                       });
    EXPECT_TRUE(server.cancel(id));
    infer::Response r = done.get_future().get();
    EXPECT_EQ(r.status(), INFER_STATUS_CANCELLED);
    EXPECT_EQ(r.request_id(), id);
    EXPECT_FALSE(server.cancel(id)); // finished: NOT_FOUND
    server.resume_model("add_sub");
}

TEST(Infer, PriorityBeyondTheLevelsIsRefusedAtEnqueue) {
    infer::Server server;
    server.load_model("add_sub",
                      support::add_sub_config("TYPE_FP32", 4,
                                              "dynamic_batching { priority_levels: 2 "
                                              "default_priority_level: 2 }"));
    EXPECT_TRUE(
        server.infer(add_sub_request(server, {1, 2, 3, 4}, {1, 1, 1, 1}).priority(1)).get().ok());
    try {
        (void)server.infer(add_sub_request(server, {1, 2, 3, 4}, {1, 1, 1, 1}).priority(3));
        FAIL() << "priority 3 of 2 levels was accepted";
    } catch (const infer::Error &e) {
        EXPECT_EQ(e.code(), INFER_STATUS_INVALID_ARGUMENT);
        EXPECT_NE(e.message().find("priority 3"), std::string::npos) << e.what();
    }
}

TEST(Infer, ParametersAndFlagsAreAccepted) {
    infer::Server server;
    server.load_model("add_sub", support::add_sub_config());
    infer::Request req = add_sub_request(server, {1, 2, 3, 4}, {1, 1, 1, 1});
    req.parameter("count", 3)
        .parameter("big", uint64_t{1} << 40)
        .parameter("ratio", 0.5)
        .parameter("on", true)
        .parameter("tag", "hello")
        .parameter("name", std::string("world"));
    EXPECT_TRUE(server.infer(std::move(req)).get().ok());
}

TEST(Infer, BorrowedInputsAreReleasedOnce) {
    infer::Server server;
    server.load_model("add_sub", support::add_sub_config());
    std::atomic<int> released{0};
    const std::vector<float> a{1, 2, 3, 4};
    auto b = std::make_shared<const std::vector<float>>(std::vector<float>{4, 3, 2, 1});
    std::weak_ptr<const std::vector<float>> b_alive = b;
    infer::Response r =
        server
            .infer(server.request("add_sub")
                       .input_borrowed<float>("INPUT0", {1, 4}, a.data(), a.size(),
                                              [&] { released++; })
                       .input_borrowed<float>("INPUT1", {1, 4}, std::move(b)))
            .get();
    ASSERT_TRUE(r.ok()) << r.error_message();
    EXPECT_EQ(r.output<float>("OUTPUT0").to_vector(), (std::vector<float>{5, 5, 5, 5}));
    EXPECT_TRUE(support::wait_until([&] { return released.load() == 1 && b_alive.expired(); }));
    EXPECT_EQ(released.load(), 1);

    // A request destroyed unsent releases its borrowed inputs too.
    {
        infer::Request unsent = server.request("add_sub");
        unsent.input_borrowed<float>("INPUT0", {1, 4}, a.data(), a.size(), [&] { released++; });
    }
    EXPECT_EQ(released.load(), 2);

    // A refused borrow never calls the functor, and destroys it.
    auto token = std::make_shared<int>(0);
    std::weak_ptr<int> token_alive = token;
    infer::Request req = server.request("add_sub");
    EXPECT_THROW(req.input_borrowed<float>("INPUT0", {1, 3}, a.data(), 3,
                                           [&, t = std::move(token)] { released += 100; }),
                 infer::Error);
    EXPECT_TRUE(token_alive.expired());
    EXPECT_EQ(released.load(), 2);
}

TEST(Infer, BytesAndBoolTensorsRoundTrip) {
    infer::Server server;
    server.load_model("echo", "backend: \"identity\"\nmax_batch_size: 4\n"
                              "input [ { name: \"TEXT\" data_type: TYPE_STRING dims: [ 3 ] },\n"
                              "        { name: \"MASK\" data_type: TYPE_BOOL dims: [ 3 ] } ]\n"
                              "output [ { name: \"TEXT_OUT\" data_type: TYPE_STRING dims: [ 3 ] },\n"
                              "         { name: \"MASK_OUT\" data_type: TYPE_BOOL dims: [ 3 ] } ]\n");
    const std::vector<std::string> words{"hello", "", "wörld"};
    infer::Response r = server
                            .infer(server.request("echo")
                                       .input_strings("TEXT", {1, 3}, words)
                                       .input<bool>("MASK", {1, 3}, std::vector<bool>{true, false, true}))
                            .get();
    ASSERT_TRUE(r.ok()) << r.error_message();
    const std::vector<std::string_view> got = r.output("TEXT_OUT").strings();
    ASSERT_EQ(got.size(), 3u);
    EXPECT_EQ(got[0], "hello");
    EXPECT_EQ(got[1], "");
    EXPECT_EQ(got[2], "wörld");
    EXPECT_EQ(r.output<bool>("MASK_OUT").to_vector(), (std::vector<bool>{true, false, true}));
}

TEST(MoveSemantics, HandlesAreMoveOnly) {
    static_assert(!std::is_copy_constructible_v<infer::Server>);
    static_assert(!std::is_copy_assignable_v<infer::Server>);
    static_assert(std::is_nothrow_move_constructible_v<infer::Server>);
    static_assert(std::is_nothrow_move_assignable_v<infer::Server>);
    static_assert(!std::is_copy_constructible_v<infer::Request>);
    static_assert(std::is_nothrow_move_constructible_v<infer::Request>);
    static_assert(!std::is_copy_constructible_v<infer::Response>);
    static_assert(std::is_nothrow_move_constructible_v<infer::Response>);
    static_assert(!std::is_copy_constructible_v<infer::ServerOptions>);
    static_assert(std::is_nothrow_move_constructible_v<infer::ServerOptions>);
    static_assert(!std::is_copy_constructible_v<infer::Batch>);
}

TEST(MoveSemantics, MovedFromHandlesThrowClearly) {
    infer::Server a;
    a.load_model("add_sub", support::add_sub_config());
    infer::Server b = std::move(a);
    EXPECT_FALSE(static_cast<bool>(a));
    EXPECT_TRUE(static_cast<bool>(b));
    try {
        a.load_model("x", support::add_sub_config());
        FAIL();
    } catch (const infer::Error &e) {
        EXPECT_EQ(e.code(), INFER_STATUS_INVALID_ARGUMENT);
        EXPECT_NE(e.message().find("infer::Server"), std::string::npos) << e.what();
    }
    EXPECT_EQ(a.callback_exception_count(), 0u);

    infer::Request r1 = add_sub_request(b, {1, 2, 3, 4}, {1, 1, 1, 1});
    infer::Request r2 = std::move(r1);
    EXPECT_FALSE(static_cast<bool>(r1));
    EXPECT_THROW(r1.priority(1), infer::Error);
    EXPECT_THROW((void)b.infer(std::move(r1)), infer::Error);

    // Moving a Response keeps its views valid.
    infer::Response resp = b.infer(std::move(r2)).get();
    EXPECT_FALSE(static_cast<bool>(r2)); // sent
    const infer::TensorView<const float> view = resp.output<float>("OUTPUT0");
    infer::Response moved = std::move(resp);
    EXPECT_FALSE(static_cast<bool>(resp));
    EXPECT_EQ(view.to_vector(), (std::vector<float>{2, 3, 4, 5}));
    EXPECT_EQ(moved.output<float>("OUTPUT0").data(), view.data());

    // Move assignment shuts the old server down first.
    infer::Server c;
    c.load_model("other", support::add_sub_config());
    c = std::move(b);
    EXPECT_TRUE(c.model_ready("add_sub"));
    EXPECT_FALSE(c.model_ready("other"));
    infer::Server d;
    infer::Server &same = d;
    d = std::move(same); // self-move leaves it as it was
    EXPECT_TRUE(static_cast<bool>(d));
}

TEST(Threads, ManyClientThreadsShareOneServer) {
    infer::Server server;
    server.load_model("add_sub",
                      support::add_sub_config("TYPE_INT32", 2,
                                              "dynamic_batching { max_queue_delay_microseconds: 200 }",
                                              16));
    std::atomic<int> wrong{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; t++) {
        threads.emplace_back([&, t] {
            for (int i = 0; i < 100; i++) {
                infer::Response r = server
                                        .infer(server.request("add_sub")
                                                   .input<int32_t>("INPUT0", {1, 2}, {t, i})
                                                   .input<int32_t>("INPUT1", {1, 2}, {i, t}))
                                        .get();
                const auto v = r.output<int32_t>("OUTPUT0");
                if (v[0] != t + i || v[1] != t + i) {
                    wrong++;
                }
            }
        });
    }
    for (auto &th : threads) {
        th.join();
    }
    EXPECT_EQ(wrong.load(), 0);
}
