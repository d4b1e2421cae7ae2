"""Helpers the tests share (no tests here): tiny targets, training fixtures, hybrid models."""
