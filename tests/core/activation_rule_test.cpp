// ActivationRule (Note [offloaded activations]): a group goes out when the next one opens, comes
// back one group ahead of its backward, and what saved nothing is passed over.
#include "blockswap/core/activation_rule.hpp"

#include <gtest/gtest.h>

#include "blockswap/core/error.hpp"

namespace blockswap {
namespace {

using Groups = std::vector<ActivationRule::Group>;

// A forward of groups first..last, each saving something.
void forward(ActivationRule& rule, ActivationRule::Group first, ActivationRule::Group last) {
  for (auto g = first; g <= last; ++g) {
    rule.open(g);
    rule.saved(g);
  }
}

TEST(ActivationRule, AGroupGoesOutWhenTheNextOpensAndTheLastStays) {
  ActivationRule rule;
  EXPECT_EQ(rule.open(0), Groups{});
  rule.saved(0);
  EXPECT_FALSE(rule.out(0));
  EXPECT_EQ(rule.open(1), Groups{0});
  rule.saved(1);
  EXPECT_TRUE(rule.out(0));
  EXPECT_EQ(rule.open(2), Groups{1});
  rule.saved(2);
  EXPECT_FALSE(rule.out(2)); // open when backward starts: never copied
  EXPECT_EQ(rule.size(), 3u);
}

TEST(ActivationRule, EachBackwardBringsBackTheGroupBeforeIt) {
  ActivationRule rule;
  forward(rule, 0, 3);
  // The last group is on the device; its backward starts bringing back the one before it.
  ActivationRule::Restore r = rule.backward_starts(3);
  EXPECT_FALSE(r.own);
  EXPECT_EQ(r.ahead, 2u);
  for (ActivationRule::Group g : {2u, 1u}) {
    r = rule.backward_starts(g);
    EXPECT_FALSE(r.own) << g; // brought one group ahead
    EXPECT_EQ(r.ahead, g - 1) << g;
  }
  r = rule.backward_starts(0);
  EXPECT_FALSE(r.own);
  EXPECT_FALSE(r.ahead);
}

TEST(ActivationRule, ABackwardNobodyPreparedBringsItsOwn) {
  ActivationRule rule;
  forward(rule, 0, 2);
  // Group 1's backward first (group 2's graph was dropped): its own were not brought back.
  rule.forget(2);
  const ActivationRule::Restore r = rule.backward_starts(1);
  EXPECT_TRUE(r.own);
  EXPECT_EQ(r.ahead, 0u);
}

TEST(ActivationRule, TheSecondStartAndAnUnknownGroupDoNothing) {
  ActivationRule rule;
  forward(rule, 0, 2);
  EXPECT_EQ(rule.backward_starts(2).ahead, 1u);
  const ActivationRule::Restore again = rule.backward_starts(2); // a graph kept: second backward
  EXPECT_FALSE(again.own);
  EXPECT_FALSE(again.ahead);
  const ActivationRule::Restore unknown = rule.backward_starts(7);
  EXPECT_FALSE(unknown.own);
  EXPECT_FALSE(unknown.ahead);
  EXPECT_FALSE(rule.out(7));
}

TEST(ActivationRule, AGroupThatSavedNothingIsPassedOver) {
  ActivationRule rule;
  rule.open(0);
  rule.saved(0);
  EXPECT_EQ(rule.open(1), Groups{0});
  EXPECT_EQ(rule.open(2), Groups{}); // group 1 saved nothing: nothing to copy
  rule.saved(2);
  EXPECT_FALSE(rule.out(1)); // nothing of it went anywhere
  // Group 2's backward brings back group 0, the last one before it that saved something.
  EXPECT_EQ(rule.backward_starts(2).ahead, 0u);
  EXPECT_FALSE(rule.backward_starts(1).own); // nothing to bring back
}

TEST(ActivationRule, AGroupWhoseBackwardStartedNeverGoesOutAgain) {
  ActivationRule rule;
  forward(rule, 0, 1);
  rule.backward_starts(1);
  rule.backward_starts(0);
  // The next forward: groups 0 and 1 are in backward (a graph kept); neither goes out.
  EXPECT_EQ(rule.open(2), Groups{});
  rule.saved(2);
  EXPECT_EQ(rule.open(3), Groups{2});
}

TEST(ActivationRule, TwoForwardsBeforeOneBackwardHandOverInTheOrderSaved) {
  ActivationRule rule;
  forward(rule, 0, 2); // first micro-batch
  forward(rule, 3, 5); // the second: opening 3 sends 2 out
  EXPECT_TRUE(rule.out(2));
  EXPECT_EQ(rule.backward_starts(5).ahead, 4u);
  EXPECT_EQ(rule.backward_starts(4).ahead, 3u);
  EXPECT_EQ(rule.backward_starts(3).ahead, 2u); // the first forward's last group
  EXPECT_EQ(rule.backward_starts(2).ahead, 1u);
}

TEST(ActivationRule, ForgottenGroupsAreSkippedAhead) {
  ActivationRule rule;
  forward(rule, 0, 3);
  rule.forget(2); // its graph was freed
  EXPECT_EQ(rule.backward_starts(3).ahead, 1u);
  EXPECT_EQ(rule.size(), 3u);
}

TEST(ActivationRule, GroupsOpenInIncreasingOrder) {
  ActivationRule rule;
  rule.open(4);
  EXPECT_THROW(rule.open(4), Error);
  EXPECT_THROW(rule.open(2), Error);
}

} // namespace
} // namespace blockswap
