// accel/training/io/json.hpp: JSON: a reader that checks everything it is given, and the quoting of a string.
//
// The JSON accel.hpp reads (a safetensors header, Hugging Face's
// model.safetensors.index.json) and writes (the trackers' metrics.jsonl and
// config.json, an index). LibTorch has no JSON reader or writer in its
// public headers, so these few lines are ours.
#pragma once

#include "accel/core/errors.hpp"
#include "accel/training/torch_nn.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail {
// A JSON value: what the safetensors header and index hold.
struct Json {
  enum class Kind { Null, Bool, Number, String, Array, Object } kind = Kind::Null;
  std::string text;  // a string's value, a number's digits
  std::vector<Json> items;
  std::vector<std::string> keys;  // an object's, in order, with values[i] (not pairs:
  std::vector<Json> values;       // std::pair<std::string, Json> needs Json complete)
  const Json* find(std::string_view key) const {
    for (std::size_t i = 0; i < keys.size(); ++i)
      if (keys[i] == key) return &values[i];
    return nullptr;
  }
};

class JsonReader {
 public:
  JsonReader(std::string_view text, std::string where) : text_(text), where_(std::move(where)) {}
  Json document() {
    Json value = parse(0);
    skip_space();
    if (i_ != text_.size()) fail("text after the JSON value");
    return value;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw RuntimeError(where_ + ": bad JSON at byte " + std::to_string(i_) + ": " + what);
  }
  void skip_space() {
    while (i_ < text_.size() && (text_[i_] == ' ' || text_[i_] == '\n' || text_[i_] == '\r' || text_[i_] == '\t')) ++i_;
  }
  bool take(char c) {
    skip_space();
    if (i_ < text_.size() && text_[i_] == c) {
      ++i_;
      return true;
    }
    return false;
  }
  void expect(char c) {
    if (!take(c)) fail(std::string("expected '") + c + "'");
  }
  std::string string() {
    expect('"');
    std::string out;
    while (true) {
      if (i_ >= text_.size()) fail("unterminated string");
      const char c = text_[i_++];
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) fail("a control character in a string");
      if (c != '\\') {
        out += c;
        continue;
      }
      if (i_ >= text_.size()) fail("unterminated escape");
      const char e = text_[i_++];
      switch (e) {
        case '"':
        case '\\':
        case '/': out += e; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          if (i_ + 4 > text_.size()) fail("short \\u escape");
          unsigned code = 0;
          const auto [end, ec] = std::from_chars(text_.data() + i_, text_.data() + i_ + 4, code, 16);
          if (ec != std::errc() || end != text_.data() + i_ + 4) fail("bad \\u escape");
          i_ += 4;
          if (code >= 0xD800 && code < 0xE000) fail("a surrogate \\u escape (names are expected to be plain)");
          if (code < 0x80) out += static_cast<char>(code);  // UTF-8
          else if (code < 0x800)
            out += {static_cast<char>(0xC0 | (code >> 6)), static_cast<char>(0x80 | (code & 0x3F))};
          else
            out += {static_cast<char>(0xE0 | (code >> 12)), static_cast<char>(0x80 | ((code >> 6) & 0x3F)),
                    static_cast<char>(0x80 | (code & 0x3F))};
          break;
        }
        default: fail("bad escape");
      }
    }
  }
  Json parse(int depth) {
    if (depth > 32) fail("nested too deep");
    skip_space();
    if (i_ >= text_.size()) fail("unexpected end");
    Json v;
    const char c = text_[i_];
    if (c == '{') {
      ++i_;
      v.kind = Json::Kind::Object;
      if (take('}')) return v;
      do {
        skip_space();
        std::string key = string();
        expect(':');
        v.keys.push_back(std::move(key));
        v.values.push_back(parse(depth + 1));
      } while (take(','));
      expect('}');
    } else if (c == '[') {
      ++i_;
      v.kind = Json::Kind::Array;
      if (take(']')) return v;
      do v.items.push_back(parse(depth + 1));
      while (take(','));
      expect(']');
    } else if (c == '"') {
      v.kind = Json::Kind::String;
      v.text = string();
    } else if (c == '-' || (c >= '0' && c <= '9')) {
      v.kind = Json::Kind::Number;
      const std::size_t start = i_;
      while (i_ < text_.size() && std::strchr("+-0123456789.eE", text_[i_])) ++i_;
      v.text = std::string(text_.substr(start, i_ - start));
    } else {
      for (const auto& [word, kind] : {std::pair{"true", Json::Kind::Bool}, std::pair{"false", Json::Kind::Bool},
                                       std::pair{"null", Json::Kind::Null}})
        if (text_.substr(i_, std::strlen(word)) == word) {
          i_ += std::strlen(word);
          v.kind = kind;
          v.text = word;
          return v;
        }
      fail("unexpected character");
    }
    return v;
  }

  std::string_view text_;
  std::string where_;
  std::size_t i_ = 0;
};

inline std::string json_quote(std::string_view text) {
  std::string out = "\"";
  for (const char c : text) {
    if (c == '"' || c == '\\') out += {'\\', c};
    else if (static_cast<unsigned char>(c) < 0x20) {
      char escape[8];
      std::snprintf(escape, sizeof escape, "\\u%04x", static_cast<unsigned>(static_cast<unsigned char>(c)));
      out += escape;
    } else out += c;
  }
  return out + "\"";
}

inline int64_t json_uint(const Json& v, const std::string& what) {
  int64_t value = -1;
  if (v.kind == Json::Kind::Number) {
    const auto [end, ec] = std::from_chars(v.text.data(), v.text.data() + v.text.size(), value);
    if (ec != std::errc() || end != v.text.data() + v.text.size()) value = -1;
  }
  if (value < 0) throw RuntimeError(what + " is not a non-negative integer");
  return value;
}
}  // namespace detail

ACCEL_NAMESPACE_END
