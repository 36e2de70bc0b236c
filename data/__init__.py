"""Data the project writes itself (the embedded default prompt seeds), shipped as package data."""
