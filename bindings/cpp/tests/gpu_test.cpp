// Device inputs and GPU outputs end to end, without a GPU: against the repository's
// stand-in CUDA driver (tests/fixtures/fake_libcuda.c, built by CMake as
// fake_cuda/libcuda.so.1), which keeps "device" memory in host RAM. main() re-runs this
// program with that folder first on LD_LIBRARY_PATH and INFER_FAKE_CUDA=one (one device,
// GPU 0), so the library and the test share one stand-in driver.
#include <gtest/gtest.h>

#include <dlfcn.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <infer/infer.hpp>

#include "support.hpp"

#ifndef INFER_FAKE_CUDA_DIR
#error "INFER_FAKE_CUDA_DIR (the folder of the stand-in libcuda.so.1) must be defined"
#endif

namespace {

using CUdeviceptr = unsigned long long;

/// The driver calls the test makes itself, from the stand-in the library also uses.
struct Driver {
    int (*init)(unsigned);
    int (*retain)(void **, int);
    int (*set_current)(void *);
    int (*mem_alloc)(CUdeviceptr *, std::size_t);
    int (*mem_free)(CUdeviceptr);
    int (*htod)(CUdeviceptr, const void *, std::size_t);
    int (*stream_sync)(void *);
    int (*dtoh)(void *, CUdeviceptr, std::size_t);
    int (*dtod_async)(CUdeviceptr, CUdeviceptr, std::size_t, void *);
    bool stand_in;

    static const Driver &get() {
        static const Driver d = [] {
            void *h = dlopen("libcuda.so.1", RTLD_NOW);
            if (h == nullptr) {
                throw std::runtime_error(std::string("dlopen libcuda.so.1: ") + dlerror());
            }
            auto sym = [h](const char *name) {
                void *p = dlsym(h, name);
                if (p == nullptr) {
                    throw std::runtime_error(std::string("the driver lacks ") + name);
                }
                return p;
            };
            Driver d{};
            d.init = reinterpret_cast<decltype(d.init)>(sym("cuInit"));
            d.retain = reinterpret_cast<decltype(d.retain)>(sym("cuDevicePrimaryCtxRetain"));
            d.set_current = reinterpret_cast<decltype(d.set_current)>(sym("cuCtxSetCurrent"));
            d.mem_alloc = reinterpret_cast<decltype(d.mem_alloc)>(sym("cuMemAlloc_v2"));
            d.mem_free = reinterpret_cast<decltype(d.mem_free)>(sym("cuMemFree_v2"));
            d.htod = reinterpret_cast<decltype(d.htod)>(sym("cuMemcpyHtoD_v2"));
            d.stream_sync = reinterpret_cast<decltype(d.stream_sync)>(sym("cuStreamSynchronize"));
            d.dtoh = reinterpret_cast<decltype(d.dtoh)>(sym("cuMemcpyDtoH_v2"));
            d.dtod_async = reinterpret_cast<decltype(d.dtod_async)>(sym("cuMemcpyDtoDAsync_v2"));
            d.stand_in = dlsym(h, "fake_cuda_counters") != nullptr;
            return d;
        }();
        return d;
    }

    /// Makes GPU 0's primary context current on this thread.
    void bind() const {
        void *ctx = nullptr;
        ASSERT_EQ(init(0), 0);
        ASSERT_EQ(retain(&ctx, 0), 0);
        ASSERT_EQ(set_current(ctx), 0);
    }
    CUdeviceptr upload(const std::vector<float> &v) const {
        CUdeviceptr p = 0;
        EXPECT_EQ(mem_alloc(&p, v.size() * sizeof(float)), 0);
        EXPECT_EQ(htod(p, v.data(), v.size() * sizeof(float)), 0);
        // From pageable memory the copy may still be in flight when it returns, and the
        // library's streams are non-blocking: wait for the legacy stream.
        EXPECT_EQ(stream_sync(nullptr), 0);
        return p;
    }
    std::vector<float> download(const void *p, std::size_t n) const {
        std::vector<float> v(n);
        EXPECT_EQ(dtoh(v.data(), reinterpret_cast<CUdeviceptr>(p), n * sizeof(float)), 0);
        return v;
    }
};

/// Y = X (a device-to-device copy on the instance's stream) and ROWS = the batch's row
/// count, computed on the host: one output in device memory and one in host memory.
class CopyInstance : public infer::Instance {
public:
    void execute(infer::Batch &batch) override {
        // On a GPU instance the batch's inputs are device addresses, and the host
        // accessors refuse them.
        if (!batch.on_gpu() || batch.cuda_stream() == nullptr) {
            throw std::runtime_error("the batch is not on a GPU instance");
        }
        if (batch.input_memory("X") != infer::MemoryLocation{infer::MemoryType::Gpu, 0}) {
            throw std::runtime_error("input X is not on GPU 0");
        }
        bool refused = false;
        try {
            (void)batch.input("X");
        } catch (const infer::Error &e) {
            refused = e.code() == INFER_STATUS_INVALID_ARGUMENT &&
                      std::string(e.what()).find("device_input") != std::string::npos;
        }
        if (!refused) {
            throw std::runtime_error("Batch::input handed out device memory as host memory");
        }
        const infer::DeviceTensor x = batch.device_input("X");
        const infer::Shape shape = x.shape();
        void *y = batch.output_device("Y", shape);
        const int rc = Driver::get().dtod_async(reinterpret_cast<CUdeviceptr>(y),
                                                reinterpret_cast<CUdeviceptr>(x.device_ptr()),
                                                x.byte_size(), batch.cuda_stream());
        if (rc != 0) {
            throw std::runtime_error("cuMemcpyDtoDAsync_v2 failed: " + std::to_string(rc));
        }
        infer::TensorView<int32_t> rows = batch.output<int32_t>("ROWS", {shape[0], 1});
        for (int32_t &r : rows) {
            r = static_cast<int32_t>(batch.size());
        }
    }
};

class Copy : public infer::Backend {
public:
    std::unique_ptr<infer::Instance> create_instance(const infer::InstanceInfo &info) override {
        if (info.gpu_device != 0) {
            throw std::runtime_error("expected an instance on GPU 0, got " +
                                     std::to_string(info.gpu_device));
        }
        return std::make_unique<CopyInstance>();
    }
};

const char *copy_config = "backend: \"gpu_copy\"\n"
                          "max_batch_size: 8\n"
                          "input [ { name: \"X\" data_type: TYPE_FP32 dims: [ 4 ] } ]\n"
                          "output [ { name: \"Y\" data_type: TYPE_FP32 dims: [ 4 ] },\n"
                          "         { name: \"ROWS\" data_type: TYPE_INT32 dims: [ 1 ] } ]\n"
                          "instance_group [ { kind: KIND_GPU count: 1 gpus: [ 0 ] } ]\n";

/// A server that must use the (stand-in) GPU, with gpu_copy and add_sub (on the CPU).
infer::Server gpu_server() {
    infer::Server server(infer::ServerOptions().gpu(infer::GpuMode::Required));
    server.register_backend("gpu_copy", std::make_shared<Copy>());
    server.load_model("gpu_copy", copy_config);
    server.load_model("add_sub", support::add_sub_config());
    return server;
}

} // namespace

TEST(StandInGpu, TheLibraryAndTheTestShareTheStandInDriver) {
    ASSERT_TRUE(Driver::get().stand_in) << "libcuda.so.1 is not the stand-in";
    infer::Server server = gpu_server();
    // GPU 0 exists, GPU 5 does not.
    EXPECT_NO_THROW(server.request("gpu_copy").output_memory(infer::MemoryType::Gpu, 0));
    try {
        (void)server.request("gpu_copy").output_memory(infer::MemoryType::Gpu, 5);
        FAIL() << "GPU 5 was accepted";
    } catch (const infer::Error &e) {
        EXPECT_EQ(e.code(), INFER_STATUS_INVALID_ARGUMENT) << e.what();
    }
}

TEST(StandInGpu, GpuOutputsAreDeviceTensorsAndHostAccessorsRefuseThem) {
    const Driver &d = Driver::get();
    d.bind();
    infer::Server server = gpu_server();
    const std::vector<float> x{1.5f, -2, 3, 4.25f};
    const CUdeviceptr dx = d.upload(x);
    std::atomic<int> released{0};

    infer::Response r = server
                            .infer(server.request("gpu_copy")
                                       .output_memory(infer::MemoryType::Gpu, 0)
                                       .input_device_raw("X", infer::DataType::FP32, {1, 4},
                                                         reinterpret_cast<const void *>(dx),
                                                         x.size() * sizeof(float), 0,
                                                         [&] { released++; }))
                            .get();
    ASSERT_TRUE(r.ok()) << r.error_message();

    // Y stayed on the device.
    const infer::MemoryLocation gpu0{infer::MemoryType::Gpu, 0};
    EXPECT_EQ(r.output_memory("Y"), gpu0);
    for (const auto &read : std::vector<std::function<void()>>{
             [&] { (void)r.output("Y"); },
             [&] { (void)r.output<float>("Y"); },
             [&] { (void)r.output<float>("Y").to_vector(); }}) {
        try {
            read();
            ADD_FAILURE() << "a GPU output was read as host memory";
        } catch (const infer::Error &e) {
            EXPECT_EQ(e.code(), INFER_STATUS_INVALID_ARGUMENT);
            EXPECT_NE(e.message().find("'Y'"), std::string::npos) << e.what();
            EXPECT_NE(e.message().find("GPU 0"), std::string::npos) << e.what();
        }
    }
    const infer::DeviceTensor y = r.device_output("Y");
    EXPECT_EQ(y.name(), "Y");
    EXPECT_EQ(y.datatype(), infer::DataType::FP32);
    EXPECT_EQ(y.shape(), (infer::Shape{1, 4}));
    EXPECT_EQ(y.element_count(), 4u);
    EXPECT_EQ(y.byte_size(), 16u);
    EXPECT_EQ(y.device_id(), 0);
    ASSERT_NE(y.device_ptr(), nullptr);
    EXPECT_EQ(d.download(y.device_ptr(), 4), x);

    // ROWS was computed on the host and copied to GPU 0, as asked; accessors by index
    // agree.
    EXPECT_EQ(r.output_memory("ROWS"), gpu0);
    EXPECT_THROW((void)r.output<int32_t>("ROWS"), infer::Error);
    const infer::DeviceTensor rows = r.device_output("ROWS");
    ASSERT_EQ(rows.byte_size(), sizeof(int32_t));
    int32_t n = 0;
    EXPECT_EQ(d.dtoh(&n, reinterpret_cast<CUdeviceptr>(rows.device_ptr()), sizeof n), 0);
    EXPECT_EQ(n, 1);
    ASSERT_EQ(r.output_count(), 2u);
    for (std::size_t i = 0; i < r.output_count(); i++) {
        EXPECT_EQ(r.output_memory_at(i), gpu0);
        EXPECT_THROW((void)r.output_at(i), infer::Error);
        const infer::DeviceTensor t = r.device_output_at(i);
        EXPECT_EQ(t.device_ptr(), t.name() == "Y" ? y.device_ptr() : rows.device_ptr());
    }

    EXPECT_TRUE(support::wait_until([&] { return released.load() == 1; }));
    EXPECT_EQ(d.mem_free(dx), 0);
}

TEST(StandInGpu, CpuModelOutputsComeOnTheGpuAskedFor) {
    const Driver &d = Driver::get();
    d.bind();
    infer::Server server = gpu_server();
    infer::Response r = server
                            .infer(server.request("add_sub")
                                       .output_memory(infer::MemoryType::Gpu, 0)
                                       .input<float>("INPUT0", {1, 4}, {1, 2, 3, 4})
                                       .input<float>("INPUT1", {1, 4}, {1, 1, 1, 1}))
                            .get();
    ASSERT_TRUE(r.ok()) << r.error_message();
    const infer::MemoryLocation gpu0{infer::MemoryType::Gpu, 0};
    for (const auto &[name, want] : std::vector<std::pair<std::string, std::vector<float>>>{
             {"OUTPUT0", {2, 3, 4, 5}}, {"OUTPUT1", {0, 1, 2, 3}}}) {
        EXPECT_EQ(r.output_memory(name), gpu0) << name;
        EXPECT_THROW((void)r.output<float>(name), infer::Error) << name;
        const infer::DeviceTensor t = r.device_output(name);
        EXPECT_EQ(t.device_id(), 0);
        EXPECT_EQ(t.shape(), (infer::Shape{1, 4}));
        ASSERT_EQ(t.byte_size(), 16u);
        EXPECT_EQ(d.download(t.device_ptr(), 4), want) << name;
    }
}

TEST(StandInGpu, WithoutOutputMemoryGpuOutputsComeToTheHost) {
    const Driver &d = Driver::get();
    d.bind();
    infer::Server server = gpu_server();
    const std::vector<float> x{9, 8, 7, 6};
    const CUdeviceptr dx = d.upload(x);
    std::atomic<int> released{0};
    infer::Response r = server
                            .infer(server.request("gpu_copy")
                                       .input_device_raw("X", infer::DataType::FP32, {1, 4},
                                                         reinterpret_cast<const void *>(dx), 16,
                                                         0, [&] { released++; }))
                            .get();
    ASSERT_TRUE(r.ok()) << r.error_message();
    // Read where the GPU instance copied it down: page-locked host memory.
    EXPECT_EQ(r.output_memory("Y"), (infer::MemoryLocation{infer::MemoryType::CpuPinned, 0}));
    EXPECT_EQ(r.output<float>("Y").to_vector(), x);
    EXPECT_TRUE(support::wait_until([&] { return released.load() == 1; }));

    // A device input of a model on the CPU is copied to the host at enqueue.
    const CUdeviceptr da = d.upload({1, 2, 3, 4});
    infer::Response s = server
                            .infer(server.request("add_sub")
                                       .input_device_raw("INPUT0", infer::DataType::FP32, {1, 4},
                                                         reinterpret_cast<const void *>(da), 16,
                                                         0, [&] { released++; })
                                       .input<float>("INPUT1", {1, 4}, {1, 1, 1, 1}))
                            .get();
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(s.output<float>("OUTPUT0").to_vector(), (std::vector<float>{2, 3, 4, 5}));
    EXPECT_TRUE(support::wait_until([&] { return released.load() == 2; }));

    // Memory that is not a device allocation is refused, and not released.
    const std::vector<float> host(4);
    auto token = std::make_shared<int>(0);
    std::weak_ptr<int> token_alive = token;
    try {
        (void)server.request("gpu_copy").input_device_raw(
            "X", infer::DataType::FP32, {1, 4}, host.data(), 16, 0,
            [&, t = std::move(token)] { released += 100; });
        ADD_FAILURE() << "host memory was taken as device memory";
    } catch (const infer::Error &e) {
        EXPECT_EQ(e.code(), INFER_STATUS_INVALID_ARGUMENT) << e.what();
    }
    EXPECT_TRUE(token_alive.expired());
    EXPECT_EQ(released.load(), 2);
    EXPECT_EQ(d.mem_free(dx), 0);
    EXPECT_EQ(d.mem_free(da), 0);
}

// Re-runs this program with the stand-in driver on the loader's path (the loader reads
// LD_LIBRARY_PATH only at start), then runs the tests.
int main(int argc, char **argv) {
    const char *scenario = std::getenv("INFER_FAKE_CUDA");
    if (scenario == nullptr || std::strcmp(scenario, "one") != 0) {
        const char *old = std::getenv("LD_LIBRARY_PATH");
        std::string path = INFER_FAKE_CUDA_DIR;
        if (old != nullptr && *old != '\0') {
            path += ":" + std::string(old);
        }
        setenv("LD_LIBRARY_PATH", path.c_str(), 1);
        setenv("INFER_FAKE_CUDA", "one", 1);
        execv("/proc/self/exe", argv);
        std::perror("execv /proc/self/exe");
        return 1;
    }
    ::testing::InitGoogleTest(&argc, argv);
    return RUN_ALL_TESTS();
}
