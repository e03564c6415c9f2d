// Shared by the C++ binding's tests: model configs and small helpers.
#ifndef INFER_CPP_TESTS_SUPPORT_HPP
#define INFER_CPP_TESTS_SUPPORT_HPP

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#ifndef INFER_TEST_REPO_DIR
#error "INFER_TEST_REPO_DIR (the repository root, holding models/) must be defined"
#endif

namespace support {

/// The checkout's root folder (models/ and tests/fixtures/ are under it).
inline std::string repo_dir() { return INFER_TEST_REPO_DIR; }

/// A built-in add_sub model of `dims` elements of `type` per row.
inline std::string add_sub_config(const std::string &type = "TYPE_FP32", int dims = 4,
                                  const std::string &extra = "", int max_batch = 8) {
    const std::string d = std::to_string(dims);
    return "backend: \"add_sub\"\n"
           "max_batch_size: " + std::to_string(max_batch) + "\n"
           "input [ { name: \"INPUT0\" data_type: " + type + " dims: [ " + d + " ] },\n"
           "        { name: \"INPUT1\" data_type: " + type + " dims: [ " + d + " ] } ]\n"
           "output [ { name: \"OUTPUT0\" data_type: " + type + " dims: [ " + d + " ] },\n"
           "         { name: \"OUTPUT1\" data_type: " + type + " dims: [ " + d + " ] } ]\n" +
           extra;
}

/// The built-in accumulator with implicit state: OUTPUT = running sum of INPUT (INT64).
inline std::string accumulator_config(int instances = 1, int max_batch = 4) {
    return "backend: \"accumulator\"\n"
           "max_batch_size: " + std::to_string(max_batch) + "\n"
           "input [ { name: \"INPUT\" data_type: TYPE_INT64 dims: [ 1 ] } ]\n"
           "output [ { name: \"OUTPUT\" data_type: TYPE_INT64 dims: [ 1 ] } ]\n"
           "instance_group [ { count: " + std::to_string(instances) + " kind: KIND_CPU } ]\n"
           "sequence_batching {\n"
           "  max_sequence_idle_microseconds: 5000000\n"
           "  direct { }\n"
           "  state [ { input_name: \"SUM_IN\" output_name: \"SUM_OUT\"\n"
           "            data_type: TYPE_INT64 dims: [ 1 ] } ]\n"
           "}\n";
}

/// Polls `done()` every millisecond until it is true or `timeout` passed.
template <class F>
bool wait_until(F done, std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
    const auto end = std::chrono::steady_clock::now() + timeout;
    while (!done()) {
        if (std::chrono::steady_clock::now() > end) {
            return false;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return true;
}

/// Every `"data": [...]` array of a reference file in tests/fixtures/models/, in file
/// order (for one case: its inputs, then its outputs).
inline std::vector<std::vector<double>> fixture_arrays(const std::string &model) {
    std::ifstream in(repo_dir() + "/tests/fixtures/models/" + model + ".json");
    std::stringstream ss;
    ss << in.rdbuf();
    const std::string text = ss.str();
    std::vector<std::vector<double>> arrays;
    const std::string key = "\"data\": [";
    for (std::size_t at = text.find(key); at != std::string::npos; at = text.find(key, at)) {
        at += key.size();
        std::vector<double> values;
        const char *p = text.c_str() + at;
        while (*p != ']' && *p != '\0') {
            char *next = nullptr;
            const double v = std::strtod(p, &next);
            if (next == p) {
                break; // not a number: the file is not what this reader expects
            }
            values.push_back(v);
            p = next;
            while (*p == ',' || *p == ' ' || *p == '\n') {
                p++;
            }
        }
        arrays.push_back(std::move(values));
    }
    return arrays;
}

} // namespace support

#endif // INFER_CPP_TESTS_SUPPORT_HPP
