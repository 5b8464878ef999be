"""modules"""
