#include <stdio.h>
#include "infer.h"

#define TRY(call) if ((call) != INFER_STATUS_OK) { \
    fprintf(stderr, "%s failed: %s\n", #call, infer_last_error_message()); return 1; }

int main(void) {
    const char *config = "backend: \"add_sub\"  max_batch_size: 8"
        "  input [ { name: \"INPUT0\" data_type: TYPE_FP32 dims: [ 4 ] },"
        "          { name: \"INPUT1\" data_type: TYPE_FP32 dims: [ 4 ] } ]"
        "  output [ { name: \"OUTPUT0\" data_type: TYPE_FP32 dims: [ 4 ] },"
        "           { name: \"OUTPUT1\" data_type: TYPE_FP32 dims: [ 4 ] } ]";
    float a[4] = {1, 2, 3, 4}, b[4] = {10, 20, 30, 40};
    const int64_t shape[2] = {1, 4};
    infer_server *server = NULL;
    infer_request *req = NULL;
    infer_response *resp = NULL;
    const void *out = NULL;

    TRY(infer_server_new(NULL, &server));
    TRY(infer_server_load_model(server, "add_sub", config, NULL));
    TRY(infer_request_new(server, "add_sub", -1, &req));
    TRY(infer_request_add_input(req, "INPUT0", INFER_DATATYPE_FP32, shape, 2, a, sizeof a));
    TRY(infer_request_add_input(req, "INPUT1", INFER_DATATYPE_FP32, shape, 2, b, sizeof b));
    TRY(infer_server_infer(server, req, &resp)); /* takes the request; waits for the FINAL response */
    if (infer_response_status(resp) != INFER_STATUS_OK) { /* the model's own result */
        fprintf(stderr, "inference failed: %s\n", infer_response_error_message(resp)); return 1; }
    TRY(infer_response_output_by_name(resp, "OUTPUT0", NULL, NULL, NULL, &out, NULL));
    const float *sum = out;
    printf("OUTPUT0 = INPUT0 + INPUT1 = [%g, %g, %g, %g]\n", sum[0], sum[1], sum[2], sum[3]);
    infer_response_free(resp);
    infer_server_free(server);
    return 0;
}
