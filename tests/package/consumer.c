/*
 * A program outside the source tree that uses the installed libinfer package: it finds
 * infer.h and the library only through the package (CMake's infer::infer or infer::static,
 * or pkg-config's infer / infer-static), runs one request through the built-in add_sub
 * model and checks the answer. INFER_EXPECTED_VERSION is the version the package
 * declares; the library it runs with must report the same.
 */
#include <stdio.h>
#include <string.h>

#include <infer.h>

#ifndef INFER_EXPECTED_VERSION
#error "build with -DINFER_EXPECTED_VERSION=\"<the package's version>\""
#endif

#define TRY(call)                                                                      \
    do {                                                                               \
        if ((call) != INFER_STATUS_OK) {                                               \
            fprintf(stderr, "consumer: %s failed: %s\n", #call, infer_last_error_message()); \
            return 1;                                                                  \
        }                                                                              \
    } while (0)

static const char CONFIG[] =
    "backend: \"add_sub\"  max_batch_size: 8"
    "  input [ { name: \"INPUT0\" data_type: TYPE_FP32 dims: [ 4 ] },"
    "          { name: \"INPUT1\" data_type: TYPE_FP32 dims: [ 4 ] } ]"
    "  output [ { name: \"OUTPUT0\" data_type: TYPE_FP32 dims: [ 4 ] },"
    "           { name: \"OUTPUT1\" data_type: TYPE_FP32 dims: [ 4 ] } ]";

int main(int argc, char **argv) {
    const char *label = argc > 1 ? argv[1] : "C";
    uint32_t major = 0, minor = 0;
    TRY(infer_api_version(&major, &minor));
    if (major != INFER_API_VERSION_MAJOR || minor < INFER_API_VERSION_MINOR) {
        fprintf(stderr, "consumer: library implements C API %u.%u, header declares %u.%u\n",
                major, minor, (unsigned)INFER_API_VERSION_MAJOR, (unsigned)INFER_API_VERSION_MINOR);
        return 1;
    }
    if (strcmp(infer_version(), INFER_EXPECTED_VERSION) != 0) {
        fprintf(stderr, "consumer: library version %s, package version %s\n", infer_version(),
                INFER_EXPECTED_VERSION);
        return 1;
    }

    const float a[4] = {1, 2, 3, 4}, b[4] = {10, 20, 30, 40};
    const int64_t shape[2] = {1, 4};
    infer_server *server = NULL;
    infer_request *req = NULL;
    infer_response *resp = NULL;
    const void *sum = NULL, *diff = NULL;
    int wrong = 0;

    TRY(infer_server_new(NULL, &server));
    TRY(infer_server_load_model(server, "add_sub", CONFIG, NULL));
    TRY(infer_request_new(server, "add_sub", -1, &req));
    TRY(infer_request_add_input(req, "INPUT0", INFER_DATATYPE_FP32, shape, 2, a, sizeof a));
    TRY(infer_request_add_input(req, "INPUT1", INFER_DATATYPE_FP32, shape, 2, b, sizeof b));
    TRY(infer_server_infer(server, req, &resp));
    TRY(infer_response_status(resp));
    TRY(infer_response_output_by_name(resp, "OUTPUT0", NULL, NULL, NULL, &sum, NULL));
    TRY(infer_response_output_by_name(resp, "OUTPUT1", NULL, NULL, NULL, &diff, NULL));
    for (int i = 0; i < 4; i++) {
        wrong += ((const float *)sum)[i] != a[i] + b[i];
        wrong += ((const float *)diff)[i] != a[i] - b[i];
    }
    infer_response_free(resp);
    infer_server_free(server);
    if (wrong) {
        fprintf(stderr, "consumer: %d wrong output values\n", wrong);
        return 1;
    }
    printf("package consumer (%s): OK, libinfer %s, C API %u.%u\n", label, infer_version(), major,
           minor);
    return 0;
}
