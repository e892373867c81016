#include "output.h"

#include <algorithm>

namespace dflash {

namespace {
// Length of the longest suffix of s that is an incomplete UTF-8 sequence.
size_t incomplete_utf8_tail(const std::string & s) {
    const size_t n = s.size();
    for (size_t back = 1; back <= std::min<size_t>(n, 4); ++back) {
        const unsigned char c = (unsigned char) s[n - back];
        if ((c & 0xC0) == 0x80) {
            continue;  // continuation byte: keep looking for the lead byte
        }
        size_t need = 1;
        if ((c & 0xE0) == 0xC0) need = 2;
        else if ((c & 0xF0) == 0xE0) need = 3;
        else if ((c & 0xF8) == 0xF0) need = 4;
        return need > back ? back : 0;
    }
    return 0;
}
}  // namespace

size_t TextStream::safe_end() const {
    size_t end = text_.size() - incomplete_utf8_tail(text_);
    // hold back a suffix that could still grow into a stop string
    for (const auto & s : stop_) {
        for (size_t k = std::min(s.size() - 1, text_.size()); k > 0; --k) {
            if (text_.compare(text_.size() - k, k, s, 0, k) == 0) {
                end = std::min(end, text_.size() - k);
                break;
            }
        }
    }
    return std::max(end, released_);
}

bool TextStream::push(const std::string & piece, std::string & released) {
    released.clear();
    if (stopped_) {
        return true;
    }
    const size_t search_from = text_.size();
    text_ += piece;
    size_t cut = std::string::npos;
    for (const auto & s : stop_) {
        if (s.empty()) {
            continue;
        }
        const size_t from = search_from >= s.size() ? search_from - s.size() + 1 : 0;
        const size_t at = text_.find(s, from);
        if (at != std::string::npos) {
            cut = std::min(cut, at);
        }
    }
    if (cut != std::string::npos) {
        text_.resize(std::max(cut, released_));
        stopped_ = true;
        released.assign(text_, released_, std::string::npos);
        released_ = text_.size();
        return true;
    }
    const size_t end = safe_end();
    released.assign(text_, released_, end - released_);
    released_ = end;
    return false;
}

void TextStream::flush(std::string & released) {
    released.assign(text_, released_, std::string::npos);
    released_ = text_.size();
}

}  // namespace dflash
