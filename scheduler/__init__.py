"""Learned SSM scheduler (issue 4): request features, training from logged verifications, policy."""
