#!/bin/bash
echo 391 > /app/answer.txt
