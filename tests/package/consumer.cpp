// The C++ side of the package consumer: uses the installed header-only binding
// <infer/infer.hpp> (CMake target infer::cpp), runs one request through the built-in
// add_sub model and checks the answer and the library's version.
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>

#include <infer/infer.hpp>

#ifndef INFER_EXPECTED_VERSION
#error "build with -DINFER_EXPECTED_VERSION=\"<the package's version>\""
#endif

static const char *CONFIG = R"(
  backend: "add_sub"
  max_batch_size: 8
  input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] },
          { name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] } ]
  output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] },
           { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 4 ] } ]
)";

int main() try {
    if (infer::library_version() != INFER_EXPECTED_VERSION) {
        std::fprintf(stderr, "consumer (C++): library version %s, package version %s\n",
                     infer::library_version().c_str(), INFER_EXPECTED_VERSION);
        return 1;
    }
    infer::Server server;
    server.load_model("add_sub", CONFIG);
    const float a[4] = {1, 2, 3, 4}, b[4] = {10, 20, 30, 40};
    infer::Response resp = server
                               .infer(server.request("add_sub")
                                          .input<float>("INPUT0", {1, 4}, a)
                                          .input<float>("INPUT1", {1, 4}, b))
                               .get();
    resp.throw_if_error();
    auto sum = resp.output<float>("OUTPUT0");
    auto diff = resp.output<float>("OUTPUT1");
    for (int i = 0; i < 4; i++) {
        if (sum[i] != a[i] + b[i] || diff[i] != a[i] - b[i]) {
            std::fprintf(stderr, "consumer (C++): wrong result at element %d\n", i);
            return 1;
        }
    }
    std::printf("package consumer (C++): OK, libinfer %s\n", infer::library_version().c_str());
    return 0;
} catch (const std::exception &e) {
    std::fprintf(stderr, "consumer (C++): %s\n", e.what());
    return 1;
}
