// libinfer C++ binding: header-only, C++17, over the C API of include/infer.h only.
//
//     #include <infer/infer.hpp>
//
//     infer::Server server;                                  // checks the C API version
//     server.load_model("add_sub", config_pbtxt);
//     infer::Response r = server.infer(server.request("add_sub")
//                                          .input<float>("INPUT0", {1, 4}, {1, 2, 3, 4})
//                                          .input<float>("INPUT1", {1, 4}, {10, 20, 30, 40}))
//                             .get();
//     for (float v : r.output<float>("OUTPUT0")) std::cout << v << "\n";
//
// Errors throw infer::Error (a std::runtime_error with code() and message()). No
// exception ever crosses into the library: response, log and release callbacks and
// custom backends run behind trampolines that catch everything.
//
// Files: error.hpp (Error, versions), tensor.hpp (DataType, Tensor, TensorView),
// request.hpp, response.hpp, backend.hpp (custom backends), server.hpp (ServerOptions,
// Server, callbacks).
#ifndef INFER_CPP_INFER_HPP
#define INFER_CPP_INFER_HPP

#if __cplusplus < 201703L
#error "infer.hpp needs C++17 or later"
#endif

#include "infer/error.hpp"
#include "infer/tensor.hpp"
#include "infer/response.hpp"
#include "infer/request.hpp"
#include "infer/backend.hpp"
#include "infer/server.hpp"

#endif // INFER_CPP_INFER_HPP
