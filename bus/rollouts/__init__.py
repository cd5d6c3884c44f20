"""The data plane's client side: requests sent, results and token deltas awaited once each,
session affinity."""
