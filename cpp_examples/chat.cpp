// Chat with a Llama-family model in text, streaming: the C++ binding over a GGUF file or a
// Hugging Face folder (config.json, model.safetensors, tokenizer.json and a chat template
// in tokenizer_config.json).
//
//   chat MODEL [options] [MESSAGE...]
//
// MODEL is a .gguf file, a Hugging Face folder, or a model folder holding version folders
// (1/, 2/, ...). With MESSAGEs, each is one user turn (scripted); without, turns are read
// from standard input, one line each, until end of input or an empty line.
//
// Each turn sends the whole conversation as `text_input` (a JSON array of messages) with
// `apply_chat_template`, so the model's own template formats it, and `streaming`: the
// reply is printed piece by piece as `text_output` arrives (pieces never split a UTF-8
// character). The reply joins the conversation for the next turn.
//
// Options: --max-tokens N (default 128), --temperature T (default 0: greedy), --seed S,
// --system TEXT (a system message first), --threads N (default 2), --ignore-eos,
// --raw (no chat template: each line is a prompt the model continues, for base models
// that have no template).
//
// Exits 1 on any error.
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <unistd.h>

#include <infer/infer.hpp>

namespace fs = std::filesystem;

namespace {

struct Options {
    std::string model;
    std::vector<std::string> messages;
    std::string system;
    int64_t max_tokens = 128;
    double temperature = 0.0;
    int64_t seed = 0;
    int threads = 2;
    bool ignore_eos = false;
    bool raw = false;
};

[[noreturn]] void usage(const char *why) {
    std::cerr << "chat: " << why
              << "\nusage: chat MODEL [--max-tokens N] [--temperature T] [--seed S] "
                 "[--system TEXT] [--threads N] [--ignore-eos] [--raw] [MESSAGE...]\n";
    std::exit(1);
}

Options parse(int argc, char **argv) {
    Options o;
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        auto value = [&]() -> std::string {
            if (i + 1 >= argc) {
                usage(("missing value for " + a).c_str());
            }
            return argv[++i];
        };
        if (a == "--max-tokens") {
            o.max_tokens = std::stoll(value());
        } else if (a == "--temperature") {
            o.temperature = std::stod(value());
        } else if (a == "--seed") {
            o.seed = std::stoll(value());
        } else if (a == "--system") {
            o.system = value();
        } else if (a == "--threads") {
            o.threads = std::stoi(value());
        } else if (a == "--ignore-eos") {
            o.ignore_eos = true;
        } else if (a == "--raw") {
            o.raw = true;
        } else if (a.rfind("--", 0) == 0) {
            usage(("unknown option " + a).c_str());
        } else if (o.model.empty()) {
            o.model = a;
        } else {
            o.messages.push_back(a);
        }
    }
    if (o.model.empty()) {
        usage("no model given");
    }
    return o;
}

/// A JSON string literal.
std::string json_string(const std::string &s) {
    std::string out = "\"";
    for (const unsigned char c : s) {
        switch (c) {
        case '"': out += "\\\""; break;
        case '\\': out += "\\\\"; break;
        case '\n': out += "\\n"; break;
        case '\r': out += "\\r"; break;
        case '\t': out += "\\t"; break;
        default:
            if (c < 0x20) {
                char buf[8];
                std::snprintf(buf, sizeof buf, "\\u%04x", c);
                out += buf;
            } else {
                out += static_cast<char>(c);
            }
        }
    }
    return out + "\"";
}

struct Message {
    std::string role, content;
};

std::string to_json(const std::vector<Message> &conversation) {
    std::string out = "[";
    for (std::size_t i = 0; i < conversation.size(); ++i) {
        out += (i ? "," : "");
        out += "{\"role\":" + json_string(conversation[i].role) +
               ",\"content\":" + json_string(conversation[i].content) + "}";
    }
    return out + "]";
}

/// The folder the server loads: MODEL itself when it holds version folders, else a
/// temporary one whose version 1 links to the file or folder.
fs::path model_folder(const fs::path &model) {
    if (fs::is_directory(model / "1")) {
        return model;
    }
    const fs::path dir = fs::temp_directory_path() / ("infer-chat-" + std::to_string(::getpid()));
    fs::remove_all(dir);
    if (fs::is_directory(model)) {
        fs::create_directories(dir);
        fs::create_directory_symlink(fs::absolute(model), dir / "1");
    } else {
        fs::create_directories(dir / "1");
        fs::create_symlink(fs::absolute(model), dir / "1" / model.filename());
    }
    return dir;
}

/// One streamed reply: pieces printed as they come, the whole kept for the conversation.
struct Reply {
    std::mutex mu;
    std::condition_variable done_cv;
    std::string text;
    std::optional<infer::Response> final;
};

} // namespace

int main(int argc, char **argv) {
    const Options o = parse(argc, argv);
    try {
        const fs::path folder = model_folder(o.model);
        infer::Server server(infer::ServerOptions()
                                 .explicit_model_control()
                                 .trusted_repository() // MODEL may be a link
                                 .gpu(infer::GpuMode::Off));
        const std::string config = "backend: \"llama\"\n"
                                   "parameters { key: \"intra_op_thread_count\" value { string_value: \"" +
                                   std::to_string(o.threads) + "\" } }\n";
        server.load_model("chat", config, folder.string());

        std::vector<Message> conversation;
        if (!o.system.empty()) {
            conversation.push_back({"system", o.system});
        }
        std::size_t scripted = 0;
        for (;;) {
            std::string line;
            if (!o.messages.empty()) {
                if (scripted == o.messages.size()) {
                    break;
                }
                line = o.messages[scripted++];
                std::cout << "> " << line << "\n";
            } else {
                std::cout << "> " << std::flush;
                if (!std::getline(std::cin, line) || line.empty()) {
                    break;
                }
            }
            conversation.push_back({"user", line});

            Reply reply;
            const std::string input = o.raw ? line : to_json(conversation);
            infer::Request req = server.request("chat")
                                     .input_strings("text_input", {1}, std::vector<std::string>{input})
                                     .parameter("apply_chat_template", !o.raw)
                                     .parameter("streaming", true)
                                     .parameter("max_tokens", o.max_tokens)
                                     .parameter("ignore_eos", o.ignore_eos);
            if (o.temperature > 0) {
                req.parameter("temperature", o.temperature).parameter("seed", o.seed);
            }
            server.enqueue(std::move(req), [&reply](infer::Response r, bool is_final) {
                std::string piece;
                if (r.ok()) {
                    const auto strings = r.output("text_output").strings();
                    if (!strings.empty()) {
                        piece = std::string(strings[0]);
                    }
                }
                std::cout << piece << std::flush;
                const std::lock_guard<std::mutex> lock(reply.mu);
                reply.text += piece;
                if (is_final) {
                    reply.final.emplace(std::move(r));
                    reply.done_cv.notify_all();
                }
            });
            std::unique_lock<std::mutex> lock(reply.mu);
            reply.done_cv.wait(lock, [&] { return reply.final.has_value(); });
            if (!reply.final->ok()) {
                std::cerr << "\nchat: " << reply.final->error_message() << "\n";
                return 1;
            }
            std::cout << "\n[" << reply.final->parameter_int("generated_tokens").value_or(0)
                      << " tokens, finish_reason " << reply.final->parameter_string("finish_reason").value_or("?")
                      << "]\n";
            conversation.push_back({"assistant", reply.text});
        }
        if (folder != fs::path(o.model)) {
            fs::remove_all(folder);
        }
    } catch (const std::exception &e) {
        std::cerr << "chat: " << e.what() << "\n";
        return 1;
    }
    return 0;
}
