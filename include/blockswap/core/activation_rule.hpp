// When a block's saved activations leave the device and when they come back: the one rule that
// the activation store of both front ends (src/torch/activation_store.cpp), the schedule
// simulator (VirtualClock, step_bound) and the timed device (time_step) follow. Pure: no torch,
// no device, no time; the caller copies what the rule names.
//
//   blockswap::ActivationRule rule;
//   // block g's forward starts:
//   for (auto out : rule.open(g)) copy_out(out);
//   if (g saves something to move) rule.saved(g);
//   // block g's backward starts:
//   const auto r = rule.backward_starts(g);
//   if (r.own) copy_in(g); // then the block waits for its own
//   if (r.ahead) copy_in(*r.ahead);
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <vector>

namespace blockswap {

// Note [offloaded activations]
// What a block's forward saves for its backward is one *group*: the front ends open one around
// each block's forward (C++: ActivationScope, which ModelOffloader::run_block opens; Python: the
// block's forward hooks, saved_tensors_hooks around its call), and a user opens one around code
// outside the block's call that saves for its backward (a checkpoint around the block).
//  - Out: a group goes to host memory when the *next* group opens, under that block's compute,
//    not when its own block ends (one block behind). The group open when backward starts, the
//    last block's, never leaves the device: its backward reads it where it is.
//  - Back: in backward, a group's first read (its block's backward starts) brings back its own
//    if nothing did, and the block waits for them; and it starts bringing back the group saved
//    last before it that is in host memory and whose backward has not started, so that each copy
//    back runs under one block's backward compute. Groups are ordered as they were saved, every
//    block list of a device together: FLUX's single blocks' first backward brings back the last
//    double block's.
//  - A group that saved nothing to move is passed over; a group whose backward started never goes
//    out again (a graph kept for a second backward reads from host memory what it needs).
// The store (activation_store.cpp, Note [saved storages]) adds what is moved: storages, not
// tensors; what stays (small ones, weights); the streams.
class ActivationRule {
public:
  using Group = std::uint64_t;

  struct Restore {
    bool own = false;           // bring the group's own back now: nothing brought them yet
    std::optional<Group> ahead; // start bringing this one back (one group ahead)
  };

  // Group `g` opens: a block's forward starts. Returns the earlier groups that go to host memory
  // now, in the order they opened: every one that saved something, is on the device and whose
  // backward has not started. Groups open in increasing order; throws Error otherwise.
  std::vector<Group> open(Group g);
  // `g` saved something that goes to host memory with it.
  void saved(Group g);
  // Group `g`'s backward starts (the first read of what it saved). The second call for a group,
  // and a call for a group the rule does not know, return nothing to do.
  Restore backward_starts(Group g);
  // What `g` saved is gone (its graph was freed), or it never opened (a failed copy): the rule
  // forgets it.
  void forget(Group g);

  bool out(Group g) const;  // went to host memory: open returned it
  std::size_t size() const; // groups known

private:
  struct Record {
    bool saved = false;
    bool out = false;     // in host memory (a copy may bring it back)
    bool back = false;    // brought back (Restore named it)
    bool started = false; // its backward started
  };
  std::map<Group, Record> groups_; // in the order they opened
  std::set<Group> on_device_;      // opened, not out, backward not started
};

} // namespace blockswap
