// Chat requests rendered and parsed with llama.cpp's common chat library (its Jinja engine), and
// JSON schemas turned into grammars by its converter: what llama-server does, behind our C API.
#pragma once

#include <memory>
#include <string>

namespace dflash {

class Target;

// GBNF for a JSON schema (llama-server's json_schema / response_format).
std::string json_schema_grammar(const std::string & schema_json);

class Chat {
public:
    // options_json: see dflash_chat_create.
    Chat(const Target & target, const char * options_json);
    ~Chat();

    std::string source() const;                       // the template in use
    std::string render(const char * request_json) const;  // see dflash_chat_render
    std::string parse(const char * render_json, const char * text, bool is_partial) const;

private:
    struct Impl;
    std::unique_ptr<Impl> impl_;
};

}  // namespace dflash
