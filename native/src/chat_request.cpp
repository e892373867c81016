// Chat requests through llama.cpp's own chat machinery (common/chat.*): its Jinja engine renders
// the GGUF's template (or an override) exactly as llama-server does, with tools, reasoning and
// continuation; its converter turns JSON schemas into grammars; its parsers split generated text
// into content, reasoning and tool calls. We only map an OpenAI request onto its inputs (the
// validation llama-server applies on the way) and its outputs back to JSON.
#include "chat_request.h"

#include "error.h"
#include "target.h"

#include "chat.h"
#include "json-schema-to-grammar.h"
#include "json.h"

#include <cstring>
#include <stdexcept>

namespace dflash {

namespace {

common_json parse_json(const char * text, const char * what) {
    if (!text) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "%s is NULL", what);
    }
    try {
        return common_json::parse(text);
    } catch (const std::exception & e) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "%s is not valid JSON: %s", what, e.what());
    }
}

template <typename T> T field(const common_json & obj, const char * key, T def) {
    if (!obj.is_object() || !obj.contains(key) || obj.at(key).is_null()) {
        return def;
    }
    try {
        return obj.at(key).get<T>();
    } catch (const std::exception &) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "'%s' has the wrong type", key);
    }
}

[[noreturn]] void bad(const std::string & msg) { fail(DFLASH_ERR_INVALID_ARGUMENT, "%s", msg.c_str()); }

}  // namespace

std::string json_schema_grammar(const std::string & schema_json) {
    const common_json schema = parse_json(schema_json.c_str(), "the JSON schema");
    try {
        return json_schema_to_grammar(schema);
    } catch (const std::exception & e) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "the JSON schema cannot be turned into a grammar: %s", e.what());
    }
}

struct Chat::Impl {
    common_chat_templates_ptr tmpls;
    bool use_jinja = true;
    bool prefill_assistant = true;
    common_reasoning_format reasoning_format = COMMON_REASONING_FORMAT_DEEPSEEK;
    bool enable_thinking = false;
    std::map<std::string, std::string> kwargs;  // values are JSON text, as llama-server keeps them
};

Chat::Chat(const Target & target, const char * options_json) : impl_(std::make_unique<Impl>()) {
    const common_json opt = options_json && options_json[0] ? parse_json(options_json, "the chat options")
                                                            : common_json::object();
    const std::string tmpl = field<std::string>(opt, "template", "");
    impl_->use_jinja = field<bool>(opt, "use_jinja", true);
    impl_->prefill_assistant = field<bool>(opt, "prefill_assistant", true);
    const std::string fmt = field<std::string>(opt, "reasoning_format", "");
    if (!fmt.empty()) {
        try {
            impl_->reasoning_format = common_reasoning_format_from_name(fmt);
        } catch (const std::exception & e) {
            bad(std::string("unknown reasoning format: ") + fmt);
        }
    }
    const std::string reasoning = field<std::string>(opt, "reasoning", "auto");
    if (reasoning != "auto" && reasoning != "on" && reasoning != "off") {
        bad("reasoning must be on, off or auto (got " + reasoning + ")");
    }
    if (reasoning != "auto") {
        impl_->kwargs["enable_thinking"] = reasoning == "on" ? "true" : "false";
    }
    if (opt.is_object() && opt.contains("chat_template_kwargs")) {
        for (const auto & [k, v] : opt.at("chat_template_kwargs").items()) {
            impl_->kwargs[k] = v.dump();
        }
    }
    try {
        impl_->tmpls = common_chat_templates_init(target.model(), tmpl);
        // this may throw for a template the Jinja engine cannot parse
        common_chat_format_example(impl_->tmpls.get(), impl_->use_jinja, impl_->kwargs);
    } catch (const std::exception & e) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "the chat template cannot be used: %s", e.what());
    }
    impl_->enable_thinking = impl_->use_jinja && reasoning != "off" &&
                             common_chat_templates_support_enable_thinking(impl_->tmpls.get());
}

Chat::~Chat() = default;

std::string Chat::source() const { return common_chat_templates_source(impl_->tmpls.get()); }

// The template side of llama-server's OpenAI chat parsing (same checks, same messages).
std::string Chat::render(const char * request_json) const {
    common_json body = parse_json(request_json, "the chat request");
    if (!body.is_object()) {
        bad("the chat request must be a JSON object");
    }
    const common_json tools = body.contains("tools") ? body.at("tools") : common_json();
    const bool has_tools = tools.is_array() && !tools.empty();
    const std::string tool_choice = field<std::string>(body, "tool_choice", "auto");
    if (!impl_->use_jinja) {
        if (has_tools) {
            bad("tools param requires --jinja flag");
        }
        if (tool_choice != "auto") {
            bad("tool_choice param requires --jinja flag");
        }
    }
    common_json json_schema = body.contains("json_schema") ? body.at("json_schema") : common_json();
    const std::string grammar = field<std::string>(body, "grammar", "");
    if (!json_schema.is_null() && !grammar.empty()) {
        bad("Cannot use both json_schema and grammar");
    }
    if (body.contains("response_format")) {
        const common_json rf = body.at("response_format");
        const std::string type = field<std::string>(rf, "type", "");
        if (type == "json_object") {
            if ((rf.is_object() && rf.contains("schema")) || json_schema.is_null() || json_schema.empty()) {
                json_schema = rf.is_object() && rf.contains("schema") ? rf.at("schema") : common_json::object();
            }
        } else if (type == "json_schema") {
            const common_json wrapper = rf.is_object() && rf.contains("json_schema") ? rf.at("json_schema")
                                                                                       : common_json::object();
            json_schema = wrapper.is_object() && wrapper.contains("schema") ? wrapper.at("schema") : common_json::object();
        } else if (!type.empty() && type != "text") {
            bad("response_format type must be one of \"text\" or \"json_object\", but got: " + type);
        }
    }
    if (json_schema.is_object() && json_schema.empty()) {
        json_schema["type"] = "object";  // an absent or empty schema means any object
    }
    if (!body.contains("messages")) {
        bad("'messages' is required");
    }
    const common_json & messages = body.at("messages");
    if (!messages.is_array()) {
        bad("Expected 'messages' to be an array");
    }
    for (size_t i = 0; i < messages.size(); ++i) {
        const common_json & msg = messages.at(i);
        if (!msg.is_object()) {
            bad("Expected each message to be an object");
        }
        const std::string role = field<std::string>(msg, "role", "");
        if (role != "assistant" && !msg.contains("content")) {
            bad("All non-assistant messages must contain 'content'");
        }
        if (role == "assistant" && !msg.contains("content") && !msg.contains("tool_calls")) {
            bad("Assistant message must contain either 'content' or 'tool_calls'!");
        }
        if (msg.contains("content")) {
            const common_json & c = msg.at("content");
            if (!c.is_string() && !c.is_null() && !c.is_array()) {
                bad("Expected 'content' to be a string or an array");
            }
            if (c.is_array()) {
                for (size_t j = 0; j < c.size(); ++j) {
                    const std::string type = field<std::string>(c.at(j), "type", "");
                    if (type != "text") {
                        bad("unsupported content part type: '" + type + "' (this server has no multimodal projector)");
                    }
                }
            }
        }
    }

    common_chat_templates_inputs in;
    try {
        auto caps = common_chat_templates_get_caps(impl_->tmpls.get());
        in.messages = common_chat_msgs_parse_oaicompat(messages);
        in.tools = common_chat_tools_parse_oaicompat(tools);
        in.tool_choice = common_chat_tool_choice_parse_oaicompat(tool_choice);
        in.json_schema = json_schema.is_null() ? "" : json_schema.dump();
        in.grammar = grammar;
        in.use_jinja = impl_->use_jinja;
        in.parallel_tool_calls = field<bool>(body, "parallel_tool_calls", caps["supports_parallel_tool_calls"]);
        in.add_generation_prompt = field<bool>(body, "add_generation_prompt", true);
        in.continue_final_message = body.contains("continue_final_message")
                                        ? common_chat_continuation_parse(body.at("continue_final_message"))
                                        : COMMON_CHAT_CONTINUATION_NONE;
    } catch (const Error &) {
        throw;
    } catch (const std::exception & e) {
        bad(e.what());
    }
    if (in.continue_final_message == COMMON_CHAT_CONTINUATION_NONE && impl_->prefill_assistant &&
        !in.messages.empty() && in.messages.back().role == "assistant") {
        if (in.messages.size() >= 2 && in.messages[in.messages.size() - 2].role == "assistant") {
            bad("Cannot have 2 or more assistant messages at the end of the list.");
        }
        in.continue_final_message = COMMON_CHAT_CONTINUATION_AUTO;
        in.add_generation_prompt = false;
    }
    if (in.continue_final_message != COMMON_CHAT_CONTINUATION_NONE && in.add_generation_prompt) {
        bad("Cannot set both add_generation_prompt and continue_final_message to true.");
    }
    if (in.continue_final_message != COMMON_CHAT_CONTINUATION_NONE && !in.messages.empty() &&
        in.messages.back().role == "assistant" && !in.messages.back().tool_calls.empty()) {
        bad("Cannot continue an assistant message that contains tool calls.");
    }
    in.reasoning_format = impl_->reasoning_format;
    if (body.contains("reasoning_format")) {
        try {
            in.reasoning_format = common_reasoning_format_from_name(field<std::string>(body, "reasoning_format", ""));
        } catch (const std::exception & e) {
            bad(e.what());
        }
    }
    in.enable_thinking = impl_->enable_thinking;
    bool parse_tool_calls = false;
    if (!in.tools.empty() && in.tool_choice != COMMON_CHAT_TOOL_CHOICE_NONE) {
        if (body.contains("grammar")) {
            bad("Cannot use custom grammar constraints with tools.");
        }
        parse_tool_calls = true;
    }
    in.chat_template_kwargs = impl_->kwargs;
    if (body.contains("chat_template_kwargs") && body.at("chat_template_kwargs").is_object()) {
        for (const auto & [k, v] : body.at("chat_template_kwargs").items()) {
            in.chat_template_kwargs[k] = v.dump();
        }
    }
    const auto think = in.chat_template_kwargs.find("enable_thinking");
    if (think != in.chat_template_kwargs.end()) {
        if (think->second == "true") {
            in.enable_thinking = true;
        } else if (think->second == "false") {
            in.enable_thinking = false;
        } else if (!think->second.empty() && think->second[0] == '"') {
            bad("invalid type for \"enable_thinking\" (expected boolean, got string)");
        }
    }
    if (body.contains("reasoning_effort")) {
        const std::string effort = field<std::string>(body, "reasoning_effort", "");
        if (effort == "none") {
            in.enable_thinking = false;
            in.chat_template_kwargs.erase("reasoning_effort");
        } else if (!effort.empty()) {
            in.chat_template_kwargs["reasoning_effort"] = common_json(effort).dump();
        }
    }

    common_chat_params out;
    try {
        out = common_chat_templates_apply(impl_->tmpls.get(), in);
    } catch (const std::exception & e) {
        bad(e.what());
    }
    common_json res = common_json::object();
    res["prompt"] = out.prompt;
    res["format"] = static_cast<int>(out.format);
    res["format_name"] = common_chat_format_name(out.format);
    res["grammar"] = out.grammar;
    res["grammar_lazy"] = out.grammar_lazy;
    res["json_schema"] = in.json_schema;
    common_json triggers = common_json::array();
    for (const auto & t : out.grammar_triggers) {
        triggers.push_back(common_json::object({{"type", static_cast<int>(t.type)}, {"value", t.value},
                                                {"token", static_cast<int>(t.token)}}));
    }
    res["grammar_triggers"] = triggers;
    common_json preserved = common_json::array();
    for (const auto & t : out.preserved_tokens) {
        preserved.push_back(t);
    }
    res["preserved_tokens"] = preserved;
    common_json stops = common_json::array();
    for (const auto & t : out.additional_stops) {
        stops.push_back(t);
    }
    res["additional_stops"] = stops;
    res["generation_prompt"] = out.generation_prompt;
    res["parser"] = out.parser;
    res["parse_tool_calls"] = parse_tool_calls;
    res["reasoning_format"] = common_reasoning_format_name(in.reasoning_format);
    res["is_continuation"] = in.continue_final_message != COMMON_CHAT_CONTINUATION_NONE;
    return res.dump();
}

std::string Chat::parse(const char * render_json, const char * text, bool is_partial) const {
    const common_json r = parse_json(render_json, "the render result");
    common_chat_parser_params p;
    p.format = static_cast<common_chat_format>(field<int>(r, "format", 0));
    p.generation_prompt = field<std::string>(r, "generation_prompt", "");
    p.parse_tool_calls = field<bool>(r, "parse_tool_calls", false);
    p.is_continuation = field<bool>(r, "is_continuation", false);
    try {
        p.reasoning_format = common_reasoning_format_from_name(field<std::string>(r, "reasoning_format", "none"));
        const std::string parser = field<std::string>(r, "parser", "");
        if (!parser.empty()) {
            p.parser.load(parser);
        }
        const common_chat_msg msg = common_chat_parse(text ? text : "", is_partial, p);
        return msg.to_json_oaicompat().dump();
    } catch (const std::exception & e) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "the generated text cannot be parsed: %s", e.what());
    }
}

}  // namespace dflash
