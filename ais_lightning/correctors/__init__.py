"""correctors"""
