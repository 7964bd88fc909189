// accel/training/io/file_digest.hpp: XXH64 and a file's digest (size and hash), by which a checkpoint knows its own files.
//
// A checkpoint lists every file it wrote with its size and XXH64 hash
// (checkpoint/files.hpp), and a load checks each file it reads against that
// list: a flipped bit, a file cut short, or a file of another run put in
// its place is refused, naming the file, before anything is loaded.
// LibTorch's own archives carry zip CRC32s, but LibTorch reads them without
// checking (its miniz is built without the reader's CRC checks), and
// safetensors has none. XXH64 (Yann Collet's, the hash of xxHash's
// XXH64 and Python's xxhash.xxh64) runs at memory speed on one core in
// portable C++; the test vectors in the tests are xxhash's own.
#pragma once

#include "accel/core/errors.hpp"
#include "accel/training/torch_nn.hpp"

#include <fcntl.h>

#include <semaphore>
#include <thread>

ACCEL_NAMESPACE_BEGIN

namespace detail {
// XXH64 with seed 0, fed in pieces of any size.
class Xxh64 {
 public:
  void update(const void* data, std::size_t n) noexcept {
    const auto* p = static_cast<const unsigned char*>(data);
    total_ += n;
    if (held_ + n < kStripe) {
      if (n) std::memcpy(buffer_ + held_, p, n);
      held_ += n;
      return;
    }
    if (held_) {
      const std::size_t fill = kStripe - held_;
      std::memcpy(buffer_ + held_, p, fill);
      consume(buffer_);
      p += fill;
      n -= fill;
      held_ = 0;
    }
    // The lanes in locals: the input (bytes, which may alias anything) would
    // otherwise make the compiler store and reload them every stripe (a
    // third of the speed).
    uint64_t v0 = v_[0], v1 = v_[1], v2 = v_[2], v3 = v_[3];
    for (; n >= kStripe; p += kStripe, n -= kStripe) {
      v0 = round(v0, read64(p));
      v1 = round(v1, read64(p + 8));
      v2 = round(v2, read64(p + 16));
      v3 = round(v3, read64(p + 24));
    }
    v_[0] = v0, v_[1] = v1, v_[2] = v2, v_[3] = v3;
    if (n) std::memcpy(buffer_, p, n);
    held_ = n;
  }
  uint64_t digest() const noexcept {
    uint64_t h = total_ >= kStripe
                     ? std::rotl(v_[0], 1) + std::rotl(v_[1], 7) + std::rotl(v_[2], 12) + std::rotl(v_[3], 18)
                     : kP5;  // (seed 0)
    if (total_ >= kStripe)
      for (const uint64_t v : v_) h = (h ^ round(0, v)) * kP1 + kP4;
    h += total_;
    const unsigned char* p = buffer_;
    std::size_t n = held_;
    for (; n >= 8; p += 8, n -= 8) h = std::rotl(h ^ round(0, read64(p)), 27) * kP1 + kP4;
    if (n >= 4) {
      h = std::rotl(h ^ (read32(p) * kP1), 23) * kP2 + kP3;
      p += 4;
      n -= 4;
    }
    for (; n > 0; ++p, --n) h = std::rotl(h ^ (*p * kP5), 11) * kP1;
    h ^= h >> 33;
    h *= kP2;
    h ^= h >> 29;
    h *= kP3;
    return h ^ (h >> 32);
  }

 private:
  static constexpr uint64_t kP1 = 11400714785074694791ull, kP2 = 14029467366897019727ull, kP3 = 1609587929392839161ull,
                            kP4 = 9650029242287828579ull, kP5 = 2870177450012600261ull;
  static constexpr std::size_t kStripe = 32;
  static uint64_t round(uint64_t acc, uint64_t input) noexcept { return std::rotl(acc + input * kP2, 31) * kP1; }
  // (little-endian, as XXH64 reads; so is every host LibTorch runs on: io/safetensors.hpp asserts it)
  static uint64_t read64(const unsigned char* p) noexcept {
    uint64_t v;
    std::memcpy(&v, p, 8);
    return v;
  }
  static uint64_t read32(const unsigned char* p) noexcept {
    uint32_t v;
    std::memcpy(&v, p, 4);
    return v;
  }
  void consume(const unsigned char* p) noexcept {
    for (int lane = 0; lane < 4; ++lane) v_[lane] = round(v_[lane], read64(p + 8 * lane));
  }

  uint64_t v_[4] = {kP1 + kP2, kP2, 0, 0 - kP1};
  unsigned char buffer_[kStripe] = {};
  std::size_t held_ = 0;
  uint64_t total_ = 0;
};

// An Xxh64 fed on a thread of its own, beside the caller's work on the
// same bytes (a write(2) into the page cache takes about as long as
// hashing them: on a machine with a core to spare the digest costs
// nothing): start(p, n) begins on a piece, wait() returns once it is
// hashed, and only then may the caller reuse the piece or start another.
// The thread is made on the first start(); if it cannot be, start() hashes
// on the caller's thread.
class HashBeside {
 public:
  explicit HashBeside(Xxh64& hash) : hash_(hash) {}
  HashBeside(const HashBeside&) = delete;
  HashBeside& operator=(const HashBeside&) = delete;
  ~HashBeside() {
    if (!thread_.joinable()) return;
    piece_ = nullptr;  // (stop)
    go_.release();
    thread_.join();
  }
  void start(const void* data, std::size_t n) noexcept {
    piece_ = data;
    size_ = n;
    if (!thread_.joinable()) {
      try {
        thread_ = std::thread([this] { run(); });
      } catch (...) {
        hash_.update(data, n);
        done_.release();
        return;
      }
    }
    go_.release();
  }
  void wait() noexcept { done_.acquire(); }

 private:
  void run() noexcept {
    for (;;) {
      go_.acquire();
      if (!piece_) return;
      hash_.update(piece_, size_);
      done_.release();
    }
  }

  Xxh64& hash_;
  const void* piece_ = nullptr;
  std::size_t size_ = 0;
  std::binary_semaphore go_{0}, done_{0};
  std::thread thread_;
};

inline uint64_t xxh64(const void* data, std::size_t n) {
  Xxh64 h;
  h.update(data, n);
  return h.digest();
}

// Whether files are hashed as they are written and checked as a checkpoint
// is read: always, but for the sharding benchmark, which turns it off for
// its baseline, to measure what the digests cost beside the I/O, side by
// side in one run (tests/bench/bench_sharding.cpp, mode checkpoint).
inline bool& file_digests_on() {
  static bool on = true;
  return on;
}

// What a checkpoint records of each file: its size and its bytes' XXH64.
struct FileDigest {
  uint64_t bytes = 0;
  uint64_t xxh64 = 0;
  bool operator==(const FileDigest&) const = default;
};
// The hash as 16 hexadecimal digits (how the manifest writes it); and back
// (none: not 16 of them).
inline std::string hex64(uint64_t value) {
  char text[17];
  std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(value));
  return text;
}
inline std::optional<uint64_t> from_hex64(const std::string& text) {
  if (text.size() != 16 || !std::all_of(text.begin(), text.end(), [](unsigned char c) { return std::isxdigit(c); }))
    return std::nullopt;
  return std::stoull(text, nullptr, 16);
}

// A file's digest, read in pieces of 1 MiB through read(2); an error names
// the file and the cause.
inline FileDigest digest_of_file(const std::filesystem::path& path) {
  constexpr std::size_t kPiece = std::size_t{1} << 20;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw RuntimeError("accel: cannot open " + path.string() + ": " + std::strerror(errno));
  std::unique_ptr<char[]> buffer(new char[kPiece]);
  Xxh64 hash;
  FileDigest digest;
  for (;;) {
    const ssize_t got = ::read(fd, buffer.get(), kPiece);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) {
      const int error = errno;
      ::close(fd);
      throw RuntimeError("accel: cannot read " + path.string() + ": " + std::strerror(error));
    }
    if (got == 0) break;
    hash.update(buffer.get(), static_cast<std::size_t>(got));
    digest.bytes += static_cast<uint64_t>(got);
  }
  ::close(fd);
  digest.xxh64 = hash.digest();
  return digest;
}
}  // namespace detail

ACCEL_NAMESPACE_END
