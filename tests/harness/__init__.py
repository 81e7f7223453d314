"""The test harness itself: zerolite.testing's rank launcher and the loss comparisons the
other tests rely on."""
