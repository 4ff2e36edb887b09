// Address -> Block* for live allocations: open addressing with linear probing
// and backward-shift deletion, so the hot path never calls malloc (a node-
// based unordered_map allocated once per allocation).
//
// May include: block.h.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "block.h"

namespace waterwave {

class PtrMap {
 public:
  PtrMap() : slots_(64) {}

  Block* find(Addr key) const {
    for (std::size_t i = home(key);; i = (i + 1) & mask()) {
      const Slot& s = slots_[i];
      if (s.key == key && s.value) return s.value;
      if (!s.value) return nullptr;
    }
  }
  void insert(Addr key, Block* value) {
    if ((size_ + 1) * 4 > slots_.size() * 3) grow();
    for (std::size_t i = home(key);; i = (i + 1) & mask()) {
      Slot& s = slots_[i];
      if (!s.value) {
        s = {key, value};
        ++size_;
        return;
      }
      if (s.key == key) {
        s.value = value;
        return;
      }
    }
  }
  bool erase(Addr key) {
    std::size_t i = home(key);
    for (;; i = (i + 1) & mask()) {
      if (!slots_[i].value) return false;
      if (slots_[i].key == key) break;
    }
    // Shift later members of the probe run back so no tombstone is needed.
    std::size_t hole = i;
    for (std::size_t j = (i + 1) & mask(); slots_[j].value; j = (j + 1) & mask()) {
      const std::size_t h = home(slots_[j].key);
      // Move j into the hole unless its home lies cyclically in (hole, j].
      const bool stays = (hole <= j) ? (hole < h && h <= j) : (hole < h || h <= j);
      if (!stays) {
        slots_[hole] = slots_[j];
        hole = j;
      }
    }
    slots_[hole] = {0, nullptr};
    --size_;
    return true;
  }
  std::size_t size() const { return size_; }
  template <typename Fn>
  void for_each(Fn fn) const {
    for (const Slot& s : slots_) {
      if (s.value) fn(s.key, s.value);
    }
  }

 private:
  struct Slot {
    Addr key = 0;
    Block* value = nullptr;
  };
  std::size_t mask() const { return slots_.size() - 1; }
  std::size_t home(Addr key) const {
    // Addresses are multiples of 512: drop those bits, then mix.
    std::uint64_t x = static_cast<std::uint64_t>(key) >> 9;
    x *= 0x9E3779B97F4A7C15ULL;
    return static_cast<std::size_t>(x >> 20) & mask();
  }
  void grow() {
    std::vector<Slot> old = std::move(slots_);
    slots_.assign(old.size() * 2, Slot{});
    size_ = 0;
    for (const Slot& s : old) {
      if (s.value) insert(s.key, s.value);
    }
  }

  std::vector<Slot> slots_;
  std::size_t size_ = 0;
};

}  // namespace waterwave
