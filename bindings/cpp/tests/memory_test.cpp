// Where tensors live: Request::output_memory, Request::input_device_raw and the
// response's memory accessors, on a server whose GPU use is Off (no GPU needed).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <infer/infer.hpp>

#include "support.hpp"

namespace {

infer::Server gpu_off_server() {
    infer::Server server(infer::ServerOptions().gpu(infer::GpuMode::Off));
    server.load_model("add_sub", support::add_sub_config());
    return server;
}

/// Runs `f`, which must throw infer::Error; returns it.
template <class F>
infer::Error thrown_by(F &&f) {
    try {
        f();
    } catch (const infer::Error &e) {
        return e;
    }
    ADD_FAILURE() << "no infer::Error was thrown";
    return infer::Error(INFER_STATUS_INTERNAL, "nothing thrown");
}

} // namespace

TEST(Memory, TypesMatchTheCApi) {
    EXPECT_EQ(static_cast<infer_memory_type>(infer::MemoryType::Cpu), INFER_MEMORY_CPU);
    EXPECT_EQ(static_cast<infer_memory_type>(infer::MemoryType::CpuPinned),
              INFER_MEMORY_CPU_PINNED);
    EXPECT_EQ(static_cast<infer_memory_type>(infer::MemoryType::Gpu), INFER_MEMORY_GPU);
    EXPECT_STREQ(infer::to_string(infer::MemoryType::Cpu), "CPU");
    EXPECT_STREQ(infer::to_string(infer::MemoryType::CpuPinned), "CPU_PINNED");
    EXPECT_STREQ(infer::to_string(infer::MemoryType::Gpu), "GPU");
    EXPECT_STREQ(infer::to_string(static_cast<infer::MemoryType>(42)), "UNKNOWN");
    const infer::MemoryLocation host{};
    EXPECT_EQ(host, (infer::MemoryLocation{infer::MemoryType::Cpu, 0}));
    EXPECT_TRUE(host.on_host());
    EXPECT_FALSE((infer::MemoryLocation{infer::MemoryType::Gpu, 1}).on_host());
    EXPECT_NE(host, (infer::MemoryLocation{infer::MemoryType::Gpu, 0}));
}

TEST(Memory, GpuOutputsAreUnavailableWithGpuOff) {
    infer::Server server = gpu_off_server();
    infer::Request req = server.request("add_sub");
    const infer::Error e = thrown_by([&] { req.output_memory(infer::MemoryType::Gpu, 0); });
    EXPECT_EQ(e.code(), INFER_STATUS_UNAVAILABLE) << e.what();
    EXPECT_FALSE(e.message().empty());
    // The refused setter leaves the request usable; host memory is accepted.
    req.output_memory(infer::MemoryType::Cpu)
        .output_memory(infer::MemoryType::CpuPinned, 0)
        .output_memory(infer::MemoryType::Cpu, 0)
        .input<float>("INPUT0", {1, 4}, {1, 2, 3, 4})
        .input<float>("INPUT1", {1, 4}, {10, 20, 30, 40});
    infer::Response r = server.infer(std::move(req)).get();
    ASSERT_TRUE(r.ok()) << r.error_message();
    EXPECT_EQ(r.output<float>("OUTPUT0").to_vector(), (std::vector<float>{11, 22, 33, 44}));
    // The rvalue form, on a temporary.
    const infer::Error e2 = thrown_by(
        [&] { (void)server.request("add_sub").output_memory(infer::MemoryType::Gpu, 3); });
    EXPECT_EQ(e2.code(), INFER_STATUS_UNAVAILABLE) << e2.what();
}

TEST(Memory, DeviceInputsAreUnavailableWithGpuOffAndNeverReleased) {
    infer::Server server = gpu_off_server();
    std::atomic<int> released{0};
    auto token = std::make_shared<int>(0);
    std::weak_ptr<int> token_alive = token;
    std::vector<float> not_device(4, 1.0f); // never read: the call is refused first
    infer::Request req = server.request("add_sub");
    const infer::Error e = thrown_by([&] {
        req.input_device_raw("INPUT0", infer::DataType::FP32, {1, 4}, not_device.data(),
                             not_device.size() * sizeof(float), 0,
                             [&, t = std::move(token)] { released++; });
    });
    EXPECT_EQ(e.code(), INFER_STATUS_UNAVAILABLE) << e.what();
    EXPECT_FALSE(e.message().empty());
    EXPECT_TRUE(token_alive.expired()) << "the release functor was kept";
    EXPECT_EQ(released.load(), 0);

    // The rvalue form, and a move-only functor.
    auto owned = std::make_unique<int>(7);
    const infer::Error e2 = thrown_by([&] {
        (void)server.request("add_sub").input_device_raw(
            "INPUT1", infer::DataType::FP32, {1, 4}, not_device.data(), 16, 0,
            [&, o = std::move(owned)] { released += *o; });
    });
    EXPECT_EQ(e2.code(), INFER_STATUS_UNAVAILABLE) << e2.what();
    EXPECT_EQ(released.load(), 0);

    // The request is still usable.
    req.input<float>("INPUT0", {1, 4}, {1, 1, 1, 1}).input<float>("INPUT1", {1, 4}, {2, 2, 2, 2});
    infer::Response r = server.infer(std::move(req)).get();
    ASSERT_TRUE(r.ok()) << r.error_message();
    EXPECT_EQ(r.output<float>("OUTPUT1").to_vector(), (std::vector<float>{-1, -1, -1, -1}));
    EXPECT_EQ(released.load(), 0);
}

TEST(Memory, HostOutputsReportCpuAndAreNotDeviceOutputs) {
    infer::Server server = gpu_off_server();
    infer::Response r = server
                            .infer(server.request("add_sub")
                                       .input<float>("INPUT0", {1, 4}, {1, 2, 3, 4})
                                       .input<float>("INPUT1", {1, 4}, {1, 1, 1, 1}))
                            .get();
    ASSERT_TRUE(r.ok()) << r.error_message();
    ASSERT_EQ(r.output_count(), 2u);
    const infer::MemoryLocation cpu{infer::MemoryType::Cpu, 0};
    for (std::size_t i = 0; i < r.output_count(); i++) {
        const infer::MemoryLocation where = r.output_memory_at(i);
        EXPECT_EQ(where.type, infer::MemoryType::Cpu);
        EXPECT_EQ(where.device_id, 0);
        EXPECT_EQ(r.output_memory(r.output_at(i).name()), cpu);
    }
    EXPECT_EQ(r.output_memory("OUTPUT0"), cpu);
    EXPECT_EQ(r.output_memory("OUTPUT1"), cpu);

    // A host output is not a device output.
    const infer::Error e = thrown_by([&] { (void)r.device_output("OUTPUT0"); });
    EXPECT_EQ(e.code(), INFER_STATUS_INVALID_ARGUMENT);
    EXPECT_NE(e.message().find("OUTPUT0"), std::string::npos) << e.what();
    EXPECT_NE(e.message().find("host memory"), std::string::npos) << e.what();
    EXPECT_THROW((void)r.device_output_at(1), infer::Error);

    // Unknown names and indexes.
    EXPECT_EQ(thrown_by([&] { (void)r.output_memory("NOPE"); }).code(), INFER_STATUS_NOT_FOUND);
    EXPECT_EQ(thrown_by([&] { (void)r.output("NOPE"); }).code(), INFER_STATUS_NOT_FOUND);
    EXPECT_EQ(thrown_by([&] { (void)r.device_output("NOPE"); }).code(), INFER_STATUS_NOT_FOUND);
    EXPECT_EQ(thrown_by([&] { (void)r.output_memory_at(2); }).code(),
              INFER_STATUS_INVALID_ARGUMENT);
    EXPECT_EQ(thrown_by([&] { (void)r.output_at(2); }).code(), INFER_STATUS_INVALID_ARGUMENT);
}

TEST(Memory, FreeAfterStreamEmptiesTheResponse) {
    infer::Server server = gpu_off_server();
    infer::Response r = server
                            .infer(server.request("add_sub")
                                       .input<float>("INPUT0", {1, 4}, {1, 2, 3, 4})
                                       .input<float>("INPUT1", {1, 4}, {1, 1, 1, 1}))
                            .get();
    ASSERT_TRUE(r.ok()) << r.error_message();
    // Host outputs only: nothing to hold back, and no CUDA is touched.
    r.free_after_stream(nullptr);
    EXPECT_EQ(r.native_handle(), nullptr);
    r.free_after_stream(nullptr); // again: nothing
}

TEST(Memory, FailedResponseThrowsItsErrorFromTheMemoryAccessors) {
    infer::Server server(infer::ServerOptions().gpu(infer::GpuMode::Off));
    server.load_model("add_sub", support::add_sub_config("TYPE_FP32", 4, "dynamic_batching { }"));
    server.pause_model("add_sub");
    infer::Response r = server
                            .infer(server.request("add_sub")
                                       .output_memory(infer::MemoryType::Cpu)
                                       .input<float>("INPUT0", {1, 4}, {1, 2, 3, 4})
                                       .input<float>("INPUT1", {1, 4}, {1, 1, 1, 1})
                                       .timeout(std::chrono::milliseconds(5)))
                            .get();
    ASSERT_EQ(r.status(), INFER_STATUS_DEADLINE_EXCEEDED);
    for (const infer::Error &e : {thrown_by([&] { (void)r.output_memory_at(0); }),
                                  thrown_by([&] { (void)r.output_memory("OUTPUT0"); }),
                                  thrown_by([&] { (void)r.device_output_at(0); }),
                                  thrown_by([&] { (void)r.device_output("OUTPUT0"); })}) {
        EXPECT_EQ(e.code(), INFER_STATUS_DEADLINE_EXCEEDED) << e.what();
        EXPECT_EQ(e.message(), r.error_message());
    }
    server.resume_model("add_sub");

    // An empty (moved-from) Response.
    infer::Response moved = std::move(r);
    EXPECT_EQ(thrown_by([&] { (void)r.output_memory_at(0); }).code(),
              INFER_STATUS_INVALID_ARGUMENT);
}
