// Quickstart with the C++ binding (bindings/cpp/include/infer/infer.hpp): start a server,
// load the built-in add_sub model, send one request, print and check the result.
#include <cstdio>
#include <exception>

#include <infer/infer.hpp>

static const char *CONFIG = R"(
  backend: "add_sub"
  max_batch_size: 8
  input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] },
          { name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] } ]
  output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] },
           { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 4 ] } ]
)";

int main() try {
    infer::Server server; // throws if libinfer's C API does not match the header
    server.load_model("add_sub", CONFIG);

    const float a[4] = {1, 2, 3, 4}, b[4] = {10, 20, 30, 40};
    infer::Response resp = server
                               .infer(server.request("add_sub")
                                          .input<float>("INPUT0", {1, 4}, a)
                                          .input<float>("INPUT1", {1, 4}, b))
                               .get();
    resp.throw_if_error(); // the model's own result

    infer::TensorView<const float> sum = resp.output<float>("OUTPUT0");
    infer::TensorView<const float> diff = resp.output<float>("OUTPUT1");
    std::printf("OUTPUT0 = INPUT0 + INPUT1 = [%g, %g, %g, %g]\n", sum[0], sum[1], sum[2], sum[3]);
    std::printf("OUTPUT1 = INPUT0 - INPUT1 = [%g, %g, %g, %g]\n", diff[0], diff[1], diff[2],
                diff[3]);
    for (std::size_t i = 0; i < 4; i++) {
        if (sum.at(i) != a[i] + b[i] || diff.at(i) != a[i] - b[i]) {
            std::fprintf(stderr, "wrong result at element %zu\n", i);
            return 1;
        }
    }
    return 0;
} catch (const infer::Error &e) {
    std::fprintf(stderr, "libinfer error %s: %s\n", e.status_name(), e.message().c_str());
    return 1;
} catch (const std::exception &e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
}
