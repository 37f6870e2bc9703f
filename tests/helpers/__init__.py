"""Test doubles, input builders and the multi-process harness that several test packages share."""
