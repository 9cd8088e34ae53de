"""Fakes that stand in for hardware the test machines do not have (phones over adb)."""
